"""Training data: the JSONL record contract (``records.py``; docs/data.md describes it for users), the synthetic
data set, images and their size, the processor, and the tools behind ``tandem data``: converters
(``convert.py``), the record checker and the bad-record policy (``check.py``), the command group (``cli.py``).
"""

"""Bring-your-own-data tools behind ``tandem data``: converters (``convert.py``), the record checker and
the bad-record policy (``check.py``), and the command group (``cli.py``). The record contract itself is
``common/assistant_json.py``; docs/data.md describes it for users.
"""

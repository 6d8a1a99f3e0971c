"""The policy model as the processes name it without loading it: which module group (vision, merger, llm) a
parameter name belongs to.
"""

"""tandem: the ``tandem`` console command (``tandem/cli.py``); the runtime lives in the process folders."""

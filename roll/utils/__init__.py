"""True utilities: masked tensor ops, atomic file writes, grouping, imports by dotted path, packing, tracking,
the console and the run's log files (console.py), and the report comparing a sweep's jobs (`roll-sweep-report`).

Nothing here knows about roles, pipelines or algorithms. May import: nothing else of roll.
"""

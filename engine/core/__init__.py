"""The engine core and the boundary around it: where it runs and how the front end talks to it.

- ``engine_core``: ``EngineCore``, the scheduler plus an executor, one step at a time.
- ``core_proc``: ``EngineCoreProc``, the core's loop (apply commands, step while there is work, report each
  step), and the wire protocol it speaks; the entry point of a child process.
- ``core_client``: ``CoreClient``, the front end's one interface to a core wherever it runs, and
  ``make_core_client``.
"""

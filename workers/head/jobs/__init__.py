"""The head's job room: what turns RQ jobs into generations for the head's core and their ends into results.

- `rq_worker.py`: the RQ worker that keeps the head's models loaded (`HeadWorker`), with its allow-listed job class;
- `dispatcher.py`: its job loop, many jobs in flight, a few Redis round trips each;
- `rq_records.py`: the loop's RQ bookkeeping: the records of its jobs (started, finished, canceled, failed),
  heartbeats and maintenance, with RQ's own calls in as few round trips as the loop allows;
- `job_function.py`: one job: its request checked, its generation submitted to the core's step loop, its result
  stored once;
- `progress.py` and `flushes.py`: a job's throttled progress, token stream and checkpoints, flushed off the loop;
- `scheduler.py`: RQ's scheduler as a thread of the head, its lock kept without Lua.

The core (workers/head: runtime, loop, rounds, batching, relay I/O, sealing, groups, beacon) never imports this room
(an import contract in pyproject.toml says so): a generation knows nothing of RQ.
"""

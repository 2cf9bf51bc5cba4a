"""``python -m lmfs.eval``: (re)write the generated tasks' JSON lines in ``data/eval/``."""

from lmfs.eval.tasks import write_task_files

for written in write_task_files():
    print(f"wrote {written} ({written.stat().st_size:,} bytes)")

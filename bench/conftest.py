"""Prints the session's benchmark table and saves it when BENCH_OUT is set (see bench/common.py)."""
import os

from bench import common


def pytest_terminal_summary(terminalreporter):
    if not common.ROWS:
        return
    terminalreporter.write_sep("=", "titan benchmark table")
    terminalreporter.write_line(common.ceilings_line())
    terminalreporter.write_line(common.table(common.ROWS))
    out = os.environ.get("BENCH_OUT")
    if out:
        out = common.save(out, common.ROWS)
        terminalreporter.write_line(f"saved {out}.json and {out}.md")

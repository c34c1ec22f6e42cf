"""DuckDB for the sparse-tensor tools: imported only where asked for (`--memory-gb`, Parquet),
and a connection whose database and spills live in a temporary folder that is removed at the
end, whatever happens."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from dynmo.tensor.coo import TensorError

# of the budget, what DuckDB may hold; the rest is this process's blocks (text and arrays)
DUCKDB_SHARE = 0.6


class OutOfCoreError(TensorError):
    """A tensor the out-of-core path cannot take (no duckdb, no room for temporary files)."""


def require():
    try:
        import duckdb
    except ImportError:
        raise OutOfCoreError("--memory-gb and Parquet files need DuckDB: pip install duckdb (or pip install 'dynmo[tensor]')") from None
    return duckdb


@contextmanager
def within(memory_gb: float, tmp_dir, what: str):
    """A DuckDB connection whose database and spills live in a new temporary folder under
    `tmp_dir`, holding at most DUCKDB_SHARE of `memory_gb`; the folder is removed at the end,
    whatever happens. Its errors become OutOfCoreError lines."""
    duckdb = require()
    try:
        work = Path(tempfile.mkdtemp(prefix=f"dynmo-{what}-", dir=tmp_dir))
    except OSError as e:
        raise OutOfCoreError(f"cannot make a temporary folder in {tmp_dir} ({e.strerror})") from None
    try:
        con = duckdb.connect(str(work / "tensor.duckdb"))
        try:
            con.execute(f"SET memory_limit = '{max(64, int(memory_gb * DUCKDB_SHARE * 1024))}MB'")
            con.execute(f"SET temp_directory = '{work / 'spill'}'")
            con.execute("SET preserve_insertion_order = false")
            con.execute("SET enable_progress_bar = false")
            yield con
        finally:
            con.close()
    except duckdb.OutOfMemoryException as e:
        raise OutOfCoreError(f"--memory-gb {memory_gb}: DuckDB ran out of memory ({str(e).splitlines()[0]}); "
                             "give more") from None
    except duckdb.Error as e:  # a full disk shows as an IO error, or as a failed commit of the log
        raise OutOfCoreError(f"temporary files in {work}: {str(e).splitlines()[0]}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)

"""Where a data step's dataset operations run: Ray Data, or this process.

The steps (:mod:`crawl2chat.stages.data.pipeline`, :mod:`~crawl2chat.stages.data.dedup`)
are written against a small part of Ray Data's ``Dataset`` API: ``map_batches``,
``groupby(...).map_groups``, ``union``, ``sort``, ``repartition``, ``materialize``,
``count``, ``take_all``, ``schema`` and ``write_parquet``. An *engine* makes the
first dataset of a step (``from_items``, ``from_arrow``, ``read_parquet``); every
later operation is a method of that dataset, so one step's code runs on either:

* ``ray``: Ray Data, on a local instance or the cluster named by ``RAY_ADDRESS``;
  the work is spread over every CPU of the cluster.
* ``local``: :class:`LocalDataset`, the same operations run at once, in order, in
  this process, on Arrow tables held in memory (the extract step alone spreads a
  large enough input over a pool of processes: ``pipeline.extract_processes``).

Why the second engine is written here: Ray Data's costs that do not grow with
the data (starting the instance, 3-5 s; scheduling each operator's tasks and
shuffles, 0.5-3 s a step) are most of a small build's time: 15.8 s for 86 pages
of which the steps' own work is well under a second. No library runs Ray Data's
API in-process (Ray's old local mode is gone and never covered Ray Data), and a
dataframe library would mean writing every step twice. :class:`LocalDataset`
implements only the operations the steps use, with the same meaning (a
``map_groups`` function sees one whole group; ``union`` of tables with different
columns fills the missing ones with nulls), so a build gives the same dataset
version on both engines (``tests/test_data_engine.py`` compares content digests).

:func:`choose` picks one from the ``data.engine`` setting: ``auto`` is ``local``
for inputs up to ``data.local_max_mb`` when no Ray cluster is named, else ``ray``; that
limit, unless set, falls with the machine's CPUs (:func:`default_local_max_mb`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

RAY, LOCAL = "ray", "local"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_local_max_mb(cpus: int) -> float:
    """The largest input ``auto`` builds in process on a machine of ``cpus`` CPUs: 32 MB x 8 /
    CPUs, at least 32 MB (128 MB on 2 CPUs, 64 MB on 4, 32 MB from 8).

    In process, extraction uses every CPU but language ID, quality and dedup run on one;
    Ray Data spreads those over every CPU too, for its fixed costs (start-up, scheduling,
    its own processes). Measured on 2 CPUs at 54 MB of WARC files (every page body
    distinct), the in-process build took 85 s against Ray's 132 s with Trafilatura and
    25 s against 38 s with Resiliparse, at 0.5 GB of memory against 2.3 GB: on 2 CPUs
    even Ray's share of the one-core steps took longer. With more CPUs those steps gain
    from Ray, and the limit falls towards the 32 MB where its fixed costs are most of a
    build's time."""
    return 32.0 * max(1.0, 8 / max(1, cpus))


def local_limit_mb(local_max_mb: float | None) -> float:
    """The ``data.local_max_mb`` in force: the setting, or when unset this machine's default."""
    return default_local_max_mb(usable_cpus()) if local_max_mb is None else local_max_mb


def choose(setting: str, files: Sequence[str], local_max_mb: float | None) -> str:
    """The engine a build over ``files`` runs on: ``setting`` unless it is ``auto``;
    then ``ray`` when ``RAY_ADDRESS`` names a cluster or a file's size cannot be read
    here (a remote URL), else ``local`` up to ``local_max_mb`` of input files (None:
    :func:`default_local_max_mb` of this machine's CPUs)."""
    if setting != "auto":
        return setting
    if os.environ.get("RAY_ADDRESS"):
        return RAY
    local_max_mb = local_limit_mb(local_max_mb)
    total = 0
    for path in files:
        try:
            total += os.path.getsize(path)
        except OSError:
            return RAY
    return LOCAL if total <= local_max_mb * 2**20 else RAY


def engine(name: str) -> "RayEngine | LocalEngine":
    if name == RAY:
        return RayEngine()
    if name == LOCAL:
        return LocalEngine()
    raise ValueError(f"unknown data engine {name!r}: use 'ray' or 'local'")


def engine_of(ds: Any) -> "RayEngine | LocalEngine":
    """The engine a dataset belongs to, for the datasets a step makes from one it was given."""
    return LocalEngine() if isinstance(ds, LocalDataset) else RayEngine()


class RayEngine:
    name = RAY

    def from_items(self, items: list[dict], num_blocks: int) -> Any:
        import ray

        return ray.data.from_items(items, override_num_blocks=num_blocks)

    def from_arrow(self, tables: list[pa.Table]) -> Any:
        import ray

        return ray.data.from_arrow(tables)

    def read_parquet(self, paths: str | list[str]) -> Any:
        import ray

        return ray.data.read_parquet(paths)

    def cpus(self) -> int:
        import ray

        return int(ray.cluster_resources().get("CPU", 1)) or 1

    @contextlib.contextmanager
    def preserving_order(self) -> Iterator[None]:
        """Operators keep their input's row order (Ray Data may reorder blocks otherwise)."""
        import ray

        options = ray.data.DataContext.get_current().execution_options
        before, options.preserve_order = options.preserve_order, True
        try:
            yield
        finally:
            options.preserve_order = before


class LocalEngine:
    name = LOCAL

    def from_items(self, items: list[dict], num_blocks: int) -> "LocalDataset":
        n = max(1, min(num_blocks, len(items)))
        bounds = np.linspace(0, len(items), n + 1).astype(int)
        return LocalDataset([pa.Table.from_pylist(items[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])

    def from_arrow(self, tables: list[pa.Table]) -> "LocalDataset":
        return LocalDataset(list(tables))

    def read_parquet(self, paths: str | list[str]) -> "LocalDataset":
        import fsspec

        tables = []
        for path in [paths] if isinstance(paths, str) else paths:
            fs, root = fsspec.core.url_to_fs(path)
            if fs.isdir(root):
                # As Ray Data lists a folder: every Parquet file below it, none under a hidden or "_" name.
                found = sorted(f for f in fs.find(root) if f.endswith(".parquet")
                               and not any(part[:1] in "._" for part in Path(f[len(root):]).parts))
            else:
                found = [root]
            tables += [pq.read_table(f, filesystem=fs) for f in found]
        return LocalDataset(tables)

    def cpus(self) -> int:
        return 1

    @contextlib.contextmanager
    def preserving_order(self) -> Iterator[None]:
        yield  # this engine always keeps the order


def _as_table(out: Any) -> pa.Table:
    if isinstance(out, pa.Table):
        return out
    if isinstance(out, dict):
        return pa.table({k: pa.array(v) if isinstance(v, np.ndarray) and v.dtype == object else v
                         for k, v in out.items()})
    if hasattr(out, "to_dict") and hasattr(out, "columns"):  # a pandas frame
        return pa.Table.from_pandas(out, preserve_index=False)
    raise TypeError(f"a batch function returned {type(out).__name__}; expected an Arrow table or a dict of columns")


def _outputs(out: Any) -> Iterator[pa.Table]:
    """A batch function's result as tables: one, or each that a generator yields."""
    if isinstance(out, Iterator):
        for item in out:
            yield _as_table(item)
    else:
        yield _as_table(out)


WRITE_FILE_BYTES = 64 << 20  # Arrow bytes a file of the local engine's writes holds at most


def _concat(tables: Iterable[pa.Table]) -> pa.Table | None:
    tables = list(tables)
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="permissive")


class LocalDataset:
    """An in-process dataset of Arrow tables (its *blocks*) with the Ray Data
    operations the data steps use. Every operation runs when called and returns
    a new dataset; ``materialize`` is therefore a no-op.

    ``cut``: the blocks are a ``repartition``'s exact cuts, which, as on Ray Data,
    are written one file each (a version's shards of ``data.shard_bytes``); whole-block
    ``map_batches`` keep them."""

    def __init__(self, blocks: list[pa.Table], cut: bool = False):
        self.blocks = blocks
        self.cut = cut

    # -- transformations

    def map_batches(self, fn: Callable, *, batch_size: int | None | str = None, batch_format: str = "default",
                    fn_kwargs: dict | None = None, fn_constructor_args: tuple = (), **_scheduling: Any
                    ) -> "LocalDataset":
        """``fn`` over batches of ``batch_size`` rows (``None``, Ray's default, or ``"auto"``:
        whole blocks); a class is built once with ``fn_constructor_args``. ``compute`` and
        other scheduling options of Ray have nothing to place here."""
        call = fn(*fn_constructor_args) if isinstance(fn, type) else fn
        whole_blocks = not isinstance(batch_size, int)
        out: list[pa.Table] = []
        for block in self.blocks:
            if block.num_rows == 0:
                continue
            step = block.num_rows if whole_blocks else batch_size
            for start in range(0, block.num_rows, step):
                batch = block.slice(start, step)
                if batch_format == "numpy":
                    batch = {name: batch[name].to_numpy(zero_copy_only=False) for name in batch.column_names}
                elif batch_format == "pandas":
                    batch = batch.to_pandas()
                outputs = list(_outputs(call(batch, **(fn_kwargs or {}))))
                # A block's outputs stay one block where the blocks are cuts to be written a file each.
                out += [_concat(outputs)] if self.cut and whole_blocks and outputs else outputs
        return LocalDataset(out, cut=self.cut and whole_blocks)

    def groupby(self, key: str, num_partitions: int | None = None) -> "_LocalGroups":  # noqa: ARG002 - Ray's shuffle width
        return _LocalGroups(self, key)

    def union(self, *others: "LocalDataset") -> "LocalDataset":
        return LocalDataset(self.blocks + [b for o in others for b in o.blocks])

    def select_columns(self, columns: Sequence[str]) -> "LocalDataset":
        return LocalDataset([b.select(list(columns)) for b in self.blocks])

    def sort(self, key: str) -> "LocalDataset":
        table = _concat(self.blocks)
        return LocalDataset([] if table is None else [table.sort_by(key)])

    def repartition(self, num_blocks: int | None = None, *, target_num_rows_per_block: int | None = None,
                    strict: bool = True) -> "LocalDataset":  # noqa: ARG002 - rows are always cut exactly
        table = _concat(self.blocks)
        if table is None:
            return LocalDataset([])
        rows = target_num_rows_per_block or -(-table.num_rows // max(num_blocks or 1, 1))
        return LocalDataset([table.slice(i, rows) for i in range(0, table.num_rows, max(rows, 1))], cut=True)

    def materialize(self) -> "LocalDataset":
        return self

    # -- results

    def count(self) -> int:
        return sum(b.num_rows for b in self.blocks)

    def take_all(self) -> list[dict]:
        return [row for b in self.blocks for row in b.to_pylist()]

    def schema(self) -> pa.Schema | None:
        return next((b.schema for b in self.blocks), None)

    def write_parquet(self, path: str, compression: str = "snappy") -> None:
        """The non-empty blocks in order: a ``repartition``'s cuts one file each, as Ray Data
        writes them; other blocks, consecutive ones together in files of up to
        ``WRITE_FILE_BYTES`` of Arrow data. A dataset without rows writes none. The local
        engine's blocks are often many small ones (dedup's groups by shard gave 35 files
        for 47 documents), and every later read of the folder pays per file (~1 ms to
        open one with pyarrow, more through a dataset)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        prefix = uuid.uuid4().hex[:12]
        files: list[list[pa.Table]] = []
        size = 0
        for block in self.blocks:
            if not block.num_rows:
                continue
            if not files or self.cut or size + block.nbytes > WRITE_FILE_BYTES:
                files.append([])
                size = 0
            files[-1].append(block)
            size += block.nbytes
        for i, blocks in enumerate(files):
            pq.write_table(_concat(blocks), f"{path}/{prefix}_{i:06d}.parquet", compression=compression)


class _LocalGroups:
    def __init__(self, ds: LocalDataset, key: str):
        self.ds, self.key = ds, key

    def map_groups(self, fn: Callable, *, fn_kwargs: dict | None = None, batch_format: str = "pyarrow",
                   **_scheduling: Any) -> LocalDataset:
        """``fn`` once per value of the key, over all rows holding it, in the key's order."""
        if batch_format != "pyarrow":
            raise ValueError("the local engine's map_groups hands Arrow tables only (batch_format='pyarrow')")
        table = _concat(self.ds.blocks)
        if table is None or table.num_rows == 0:
            return LocalDataset([])
        table = table.sort_by(self.key)
        runs = pc.run_end_encode(table[self.key].combine_chunks())
        ends = runs.run_ends.to_pylist()
        out: list[pa.Table] = []
        start = 0
        for end in ends:
            out += _outputs(fn(table.slice(start, end - start), **(fn_kwargs or {})))
            start = end
        return LocalDataset(out)

"""The documents of `dynmo data prepare`'s sources, streamed in one fixed order.

A source is a file or a folder: `.txt`/`.md` files (one document each), `.jsonl` files
(optionally `.gz` or `.zst`; one document per line, its text in `field`), `.parquet` files (the
`field` column) or a Hugging Face dataset saved on disk (`save_to_disk`: its Arrow files, the
`field` column). A folder is read in sorted order of its files' paths.

Each document comes as a `Record`: its size in bytes, known before it is decoded (a text file's
size, a JSON line's length, a string column's byte length), and `text()`, which decodes it.
The preparation splits the stream into shards by those sizes, so a worker reads past the
documents of other workers' shards without decoding them. `zstandard` and `pyarrow` are
imported only for the files that need them.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dynmo.data.corpus import TEXT_SUFFIXES, DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst")
READ_BUFFER = 1 << 20


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: str  # text | jsonl | parquet | arrow

    @property
    def size(self) -> int:
        return self.path.stat().st_size


@dataclass
class Record:
    size: int
    text: Callable[[], str]


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if path.suffix.lower() in TEXT_SUFFIXES:
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def _hf_saved(folder: Path) -> list[Path] | None:
    """The Arrow files of a dataset saved by `save_to_disk` (a Dataset or a DatasetDict), in order."""
    if (folder / "state.json").is_file():
        state = json.loads((folder / "state.json").read_text())
        return [folder / f["filename"] for f in state.get("_data_files", [])]
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        return [f for s in splits for f in (_hf_saved(folder / s) or [])]
    return None


def source_files(paths: list[str]) -> list[SourceFile]:
    """Every file of the sources, in order; a missing path or a source with no readable file is refused."""
    out: list[SourceFile] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            kind = _kind(p)
            if kind is None:
                raise DataError(f"{raw}: not a format dynmo reads (.txt, .md, .jsonl[.gz|.zst], .parquet, "
                                "or a folder saved by datasets' save_to_disk)")
            out.append(SourceFile(p, kind))
        elif p.is_dir():
            arrow = _hf_saved(p)
            if arrow is not None:
                found = [SourceFile(f, "arrow") for f in arrow]
            else:
                found = [SourceFile(f, k) for f in sorted(p.rglob("*")) if f.is_file() and (k := _kind(f))]
            if not found:
                raise DataError(f"source {raw} holds no file dynmo reads (.txt, .md, .jsonl[.gz|.zst], .parquet)")
            out.extend(found)
        else:
            raise DataError(f"source {raw} does not exist")
    return out


class CountingReader(io.RawIOBase):
    """A raw file that counts the bytes read from disk (the progress of a compressed stream)."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.count += n or 0
        return n


def open_lines(path: Path, counter: CountingReader) -> io.BufferedReader:
    name = path.name.lower()
    if name.endswith(".gz"):
        return io.BufferedReader(gzip.GzipFile(fileobj=counter), READ_BUFFER)
    if name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(counter, read_across_frames=True),
                                 READ_BUFFER)
    return io.BufferedReader(counter, READ_BUFFER)


def _json_text(line: bytes, field: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where} is not JSON ({e})") from None
    if not isinstance(obj, dict) or field not in obj:
        keys = ", ".join(list(obj)[:8]) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{where} has no field {field!r} (it has: {keys}); name the text's field with --field")
    text = obj[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} holds a {type(text).__name__}, not text; choose another --field")
    return text


def _jsonl(path: Path, field: str, progress: list[int]) -> Iterator[Record]:
    with open(path, "rb", buffering=0) as raw:
        counter = CountingReader(raw)
        base = progress[0]
        with open_lines(path, counter) as f:
            for n, line in enumerate(f, 1):
                progress[0] = base + counter.count
                if line.strip():
                    yield Record(len(line), lambda line=line, n=n: _json_text(line, field, f"{path}, line {n},"))
    progress[0] = base + path.stat().st_size


def _column_batches(sf: SourceFile, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if sf.kind == "parquet":
        pf = pq.ParquetFile(sf.path)
        if field not in pf.schema_arrow.names:
            raise DataError(f"{sf.path} has no column {field!r} (it has: {', '.join(pf.schema_arrow.names[:8])}); "
                            "name the text's column with --field")
        yield from pf.iter_batches(batch_size=1024, columns=[field])
        return
    with pa.memory_map(str(sf.path)) as src:
        try:
            reader = pa.ipc.open_stream(src)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(src)
            reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in reader:
            if field not in batch.schema.names:
                raise DataError(f"{sf.path} has no column {field!r} (it has: {', '.join(batch.schema.names[:8])}); "
                                "name the text's column with --field")
            yield batch


def _columnar(sf: SourceFile, field: str, progress: list[int]) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.compute as pc

    base = progress[0]
    for batch in _column_batches(sf, field):
        col = batch.column(batch.schema.get_field_index(field))
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            raise DataError(f"{sf.path}: column {field!r} holds {col.type}, not text; choose another --field")
        sizes = pc.fill_null(pc.binary_length(col), 0).to_pylist()
        for i, size in enumerate(sizes):
            if size:
                yield Record(size, lambda col=col, i=i: col[i].as_py())
    progress[0] = base + sf.size


def _text(sf: SourceFile, progress: list[int]) -> Iterator[Record]:
    size = sf.size
    if size:
        yield Record(size, lambda: sf.path.read_text(encoding="utf-8", errors="replace"))
    progress[0] += size


def records(files: list[SourceFile], field: str, progress: list[int] | None = None) -> Iterator[Record]:
    """Every document of `files`, in order; `progress[0]` counts the bytes read from disk so far."""
    progress = progress if progress is not None else [0]
    for sf in files:
        if sf.kind == "text":
            yield from _text(sf, progress)
        elif sf.kind == "jsonl":
            yield from _jsonl(sf.path, field, progress)
        else:
            yield from _columnar(sf, field, progress)


def check_first(files: list[SourceFile], field: str) -> None:
    """Each file's first document decodes (the field or column is there), and the sources hold text."""
    any_doc = False
    for sf in files:
        for rec in records([sf], field):
            any_doc = bool(rec.text()) or any_doc
            break
    if not any_doc:
        raise DataError(f"the sources ({', '.join(str(f.path) for f in files[:3])}{', ...' if len(files) > 3 else ''}) "
                        "hold no text: every file is empty")

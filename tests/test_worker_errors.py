"""Every error a user can cause ends in one line: before launch where a check can see it, from
the first failing worker where only a worker can.

Bad files are made for real (a safetensors file cut short or missing a tensor, a checkpoint
shard cut short or damaged inside) and given to the real launcher (`dynmo train --nproc 2`);
the assertions are on the exit status, the lines on stderr, and the run folder, which a refused
run leaves byte for byte as it was. The pieces (the header checks, the choice of checkpoint,
the report of the first failing rank) are also tested in-process, without launching anything.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dynmo import hf_config, rundir
from dynmo.config import Config, ConfigError, apply_dict
from tests.conftest import metrics, run_train

# Run at start-up by every process of the job; the workers are forked from a fork server that
# started before any rank existed, so the rank is read when the step runs.
BOOM = '''
import os
if os.environ.get("DYNMO_LAUNCHED") == "1":  # torchrun's agent and the workers' fork server
    import dynmo.trainer

    _step = dynmo.trainer.Trainer._train_step

    def _train_step(self, step, events):
        if step == 1 and os.environ.get("RANK") == "1":
            raise RuntimeError("injected at step 1")
        return _step(self, step, events)

    dynmo.trainer.Trainer._train_step = _train_step
'''


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Everything under `folder` by relative path: a file's bytes, None for a folder."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def assert_one_line(p, status: int, message: str) -> str:
    """Exit `status`, at most 3 lines on stderr, one error line holding `message`, no traceback
    and nothing of torchrun's report. Returns the error line."""
    assert p.returncode == status, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) <= 3, p.stderr[-3000:]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr
    return errors[0]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(out)]


def cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ---- a saved run to damage -----------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """One finished run with checkpoints after steps 2, 4 and 6; each test damages a copy."""
    out = tmp_path_factory.mktemp("saved") / "run"
    run_train(out, "--steps", "6", "--checkpoint.every", "2")
    return out


def copy_of(saved_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved_run, out)
    return out


@pytest.mark.dist
def test_a_truncated_shard_named_explicitly_is_refused_before_launch(saved_run, tmp_path):
    out = copy_of(saved_run, tmp_path)
    shard = out / "checkpoint-6" / "__1_0.distcp"
    cut(shard, shard.stat().st_size // 2)
    before = snapshot(out)
    p = run_train(out, "--steps", "8", "--checkpoint.resume", str(out / "checkpoint-6"), check=False)
    line = assert_one_line(p, 2, f"checkpoint shard {shard} is truncated")
    assert line.startswith("dynmo train: error:") and "resume from another checkpoint" in line  # nothing launched
    assert snapshot(out) == before


@pytest.mark.dist
def test_resume_latest_falls_back_past_a_truncated_shard_and_finishes(saved_run, tmp_path):
    out = copy_of(saved_run, tmp_path)
    shard = out / "checkpoint-6" / "__0_0.distcp"
    cut(shard, 1000)
    p = run_train(out, "--steps", "6", "--checkpoint.every", "2", "--checkpoint.resume", "latest", check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) <= 3, p.stderr
    notes = [line for line in lines if "skipping checkpoint-6" in line]
    assert len(notes) == 1 and f"resuming from {out / 'checkpoint-4'}" in notes[0] and "is truncated" in notes[0]
    assert losses(out) == losses(saved_run)  # steps 4 and 5 trained again, bitwise the same
    assert shard.stat().st_size == (saved_run / "checkpoint-6" / "__0_0.distcp").stat().st_size  # saved anew


@pytest.mark.dist
def test_a_shard_damaged_inside_is_refused_by_the_worker_leaving_the_folder_as_it_was(saved_run, tmp_path,
                                                                                      monkeypatch):
    """The sizes are right, so the checks before launch pass; the rank that reads the shard
    refuses it: one line naming the rank and the file, status 2, the traceback outside --out."""
    out = copy_of(saved_run, tmp_path)
    shard = out / "checkpoint-6" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:4] = b"XXXX"  # the first entry's archive header
    shard.write_bytes(bytes(data))
    before = snapshot(out)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    p = run_train(out, "--steps", "8", "--checkpoint.resume", "latest", check=False)
    line = assert_one_line(p, 2, f"checkpoint shard {shard} (entry ")
    assert line.startswith("dynmo: error: rank ") and "resume from another checkpoint" in line
    kept = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert kept.parent == temp and "Traceback" in kept.read_text()
    assert [f.name for f in temp.glob("dynmo-rank*")] == [kept.name]  # the other rank's, not shown, is removed
    assert snapshot(out) == before


@pytest.mark.dist
def test_an_unexpected_exception_shows_its_traceback_once(tmp_path, monkeypatch):
    """Rank 1 raises a RuntimeError at step 1 (a sitecustomize module patches the trainer):
    its traceback once, then its line; status 1; the traceback kept in the run folder."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BOOM)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    p = run_train(out, "--steps", "4", "--parallel.timeout_s", "30", check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert p.stderr.count("Traceback (most recent call last)") == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("dynmo: error: rank 1: unexpected RuntimeError: injected at step 1"), p.stderr
    assert "ChildFailedError" not in p.stderr and "[rank" not in p.stderr
    assert "injected at step 1" in (out / "errors" / "rank-1.txt").read_text()
    assert f"(traceback: {out / 'errors' / 'rank-1.txt'})" in last


# ---- Hugging Face folders --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.test_hf import save_model

    return save_model(tmp_path_factory.mktemp("hf") / "llama", "llama", vocab=320)


def hf_copy(hf_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    return folder


def drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    tensors = load_file(path)
    del tensors[name]
    save_torch(tensors, path, metadata={"format": "pt"})


@pytest.mark.dist
@pytest.mark.parametrize("damage,message", [
    ("truncated", "model.safetensors is truncated: its header places"),
    ("missing", ("the safetensors lack 1 tensors the llama model of config.json needs, first "
                 "model.layers.1.mlp.up_proj.weight")),
])
def test_a_bad_safetensors_file_is_refused_before_launch(hf_folder, tmp_path, damage, message):
    folder = hf_copy(hf_folder, tmp_path)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        cut(weights, weights.stat().st_size - 1000)
    else:
        drop_tensor(weights, "model.layers.1.mlp.up_proj.weight")
    out = tmp_path / "run"
    p = run_train(out, "--model.hf_path", str(folder), check=False)
    assert_one_line(p, 2, message)
    assert not out.exists()


def test_hf_header_checks_agree_with_safetensors(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones(3, np.float16)}, str(path))
    assert sorted(hf_config.read_header(path)) == ["a", "b"]
    whole = path.read_bytes()
    for damaged, message in [(whole[:-2], "is truncated: its header places"),
                             (whole[:20], "is truncated: it ends inside its header"),
                             (whole + b"\0" * 8, "has 8 bytes after its last tensor")]:
        path.write_bytes(damaged)
        with pytest.raises(ConfigError, match=message) as e:
            hf_config.read_header(path)
        assert str(path) in str(e.value) and "copy it again" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(SafetensorError):
            safe_open(str(path), framework="numpy")


def test_an_index_that_misplaces_a_tensor_is_refused(hf_folder, tmp_path):
    """A sharded folder whose index names a shard that does not hold the tensor."""
    folder = hf_copy(hf_folder, tmp_path)
    single = folder / "model.safetensors"
    with safe_open(str(single), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a handle, not a dict)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for shard, held in shards.items():
        save_file({k: tensors[k] for k in held}, str(folder / shard))
    single.unlink()
    weight_map = {k: shard for shard, held in shards.items() for k in held}
    weight_map[names[0]] = "b.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = Config()
    apply_dict(cfg, {"model": {"hf_path": str(folder), "seq_len": 32}})
    with pytest.raises(ConfigError, match=f"places {names[0]} in b.safetensors, which does not hold it"):
        hf_config.apply(cfg)


def test_the_loader_names_a_file_damaged_after_the_checks(hf_folder, tmp_path):
    from dynmo.model.hf import HFCheckpointError, HFReader

    folder = hf_copy(hf_folder, tmp_path)
    weights = folder / "model.safetensors"
    cut(weights, weights.stat().st_size - 1000)
    with pytest.raises(HFCheckpointError, match="copy it again") as e:
        HFReader(folder)
    assert str(weights) in str(e.value) and "\n" not in str(e.value)


# ---- choosing the checkpoint ---------------------------------------------------------------


def test_resume_latest_skips_checkpoints_that_fail_and_says_so(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "dynmo.json").write_text(json.dumps({"step": step}))
    bad = {"checkpoint-6": "shard cut short", "checkpoint-4": "shard cut short too"}

    def verify(path: str) -> None:
        if Path(path).name in bad:
            raise ConfigError(bad[Path(path).name])

    chosen, note = rundir.resolve_resume("latest", str(tmp_path), verify)
    assert chosen == str(tmp_path / "checkpoint-2")
    assert note.startswith("checkpoint.resume = latest: skipping checkpoint-6 and checkpoint-4, which fail their "
                           "checks (shard cut short)")
    assert rundir.resolve_resume("latest", str(tmp_path)) == (str(tmp_path / "checkpoint-6"), "")
    with pytest.raises(ConfigError, match="shard cut short"):
        rundir.resolve_resume(str(tmp_path / "checkpoint-6"), str(tmp_path), verify)  # named: refused
    bad["checkpoint-2"] = "no"
    with pytest.raises(ConfigError, match="no checkpoint in .* can be resumed; the newest, checkpoint-6: shard cut"):
        rundir.resolve_resume("latest", str(tmp_path), verify)


# ---- the report: one line, from the first failing rank ----------------------------------------


def failed_rank(tmp_path: Path, monkeypatch, rank: int, error: BaseException, exitcode: int):
    """What torchrun's agent holds for a worker that reported `error` (a ProcessFailure)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dynmo.runtime import failures

    error_file = tmp_path / f"error-{rank}.json"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # temporary tracebacks go here
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise error
    except BaseException as e:
        status = failures.report(e, failures.describe(e, rank), rank, show=False)  # as under dynmo train
    assert status == exitcode
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=status, error_file=str(error_file))


def test_the_first_failing_rank_is_reported_in_one_line(tmp_path, monkeypatch, capfd):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dynmo.runtime import failures
    from dynmo.runtime.safeload import CheckpointError

    first = failed_rank(tmp_path, monkeypatch, 1, CheckpointError("checkpoint shard x is not plain tensor data"), 2)
    later = failed_rank(tmp_path, monkeypatch, 0, failures.Diverged("the loss is nan"), 1)
    assert capfd.readouterr().err == ""  # under dynmo train the workers print nothing themselves
    stopped = ProcessFailure(local_rank=2, pid=102, exitcode=-15, error_file=str(tmp_path / "none.json"))
    text, status = failures.first_failure({0: later, 1: first, 2: stopped})
    assert status == 2 and text.count("\n") == 1
    assert text.startswith("dynmo: error: rank 1: checkpoint shard x is not plain tensor data; resume from another")
    kept = Path(text.rsplit("(traceback: ", 1)[1].strip().rstrip(")"))
    assert "Traceback" in kept.read_text()
    later_kept = json.loads(Path(later.error_file).read_text())["dynmo"]["temporary"]
    assert not Path(later_kept).exists()  # the line not shown: its temporary traceback is gone
    kept.unlink()


def test_an_unexpected_error_shows_its_traceback_and_a_silent_death_is_named(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dynmo.runtime import failures

    bug = failed_rank(tmp_path, monkeypatch, 0, KeyError("oops"), 1)
    text, status = failures.first_failure({0: bug})
    assert status == 1 and text.startswith("Traceback (most recent call last)") and text.count("Traceback") == 1
    assert text.splitlines()[-1].startswith("dynmo: error: rank 0: unexpected KeyError: 'oops'")
    # rank 1 was killed; torchrun then stopped rank 0 (SIGTERM), which is not the cause
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=str(tmp_path / "none.json"))
    killed = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=str(tmp_path / "none.json"))
    text, status = failures.first_failure({0: stopped, 1: killed}, str(tmp_path))
    assert status == 1 and text.count("\n") == 1
    assert text.startswith("dynmo: error: rank 1 ended with signal SIGKILL without a message")
    assert "No checkpoint was saved yet." in text


def test_a_rank_prints_each_line_in_one_write_even_unbuffered(monkeypatch):
    """Ranks share stdout; under PYTHONUNBUFFERED `print` writes a line and its newline in two
    writes, and another rank's line could land between them."""
    import io

    from dynmo.train import whole_lines

    class Recorder(io.RawIOBase):
        def __init__(self):
            self.writes: list[bytes] = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    for name in ("stdout", "stderr"):
        raw = Recorder()
        monkeypatch.setattr(sys, name, io.TextIOWrapper(raw, write_through=True))  # what -u gives
        print("dynmo: rank 0 read 19 tensors", file=getattr(sys, name), flush=True)
        assert raw.writes == [b"dynmo: rank 0 read 19 tensors", b"\n"]  # the case being fixed
        raw.writes.clear()
        whole_lines()
        print("dynmo: rank 0 read", 19, "tensors", file=getattr(sys, name), flush=True)
        print("Traceback ...\nValueError: x\ndynmo: error: x\n", end="", file=getattr(sys, name))
        assert raw.writes == [b"dynmo: rank 0 read 19 tensors\n", b"Traceback ...\nValueError: x\ndynmo: error: x\n"]


def test_a_long_temporary_folder_path_still_launches(tmp_path):
    """The workers' fork server listens on a Unix socket in a temporary folder, and a socket's
    path holds at most 107 bytes: a long TMPDIR must not stop the job."""
    long = tmp_path / ("d" * 90)
    long.mkdir()
    p = run_train(tmp_path / "run", "--steps", "1", env={"TMPDIR": str(long)}, check=False)
    assert p.returncode == 0, p.stderr[-3000:]

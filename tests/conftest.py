import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI (CI=true) runs the property tests on a fixed sequence of examples, so a red CI is
# reproducible and not an unlucky draw; a developer's run keeps exploring new examples (and
# hypothesis saves any failure it finds to .hypothesis/ to replay next time).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parents[1]

# A tiny model that still exercises every mechanism; compute per step is milliseconds.
TINY = [
    "--model.n_layers", "4", "--model.d_model", "64", "--model.n_heads", "2", "--model.seq_len", "32",
    "--model.vocab_size", "512", "--train.global_batch", "8", "--train.microbatches", "4",
    "--train.warmup_steps", "2", "--log.tensorboard", "false", "--log.progress", "false",
]

# What a run of the tiny model with `--skew.blocks 0 --skew.factor 16 --skew.start_step 3`
# records, as injected costs (ms per microbatch, dynmo.runtime.faults): E t t t t L nearly
# balanced on `E t t | t t L` (9 vs 11 ms), then block 0 at ~3.5x a plain block from step 3,
# as a quiet machine measures it (19 vs 11 ms; `E t | t t t L` gives 15 vs 15). A test of what
# the controller decides on a skewed run reads these, never this machine's timing.
SKEWED_COSTS = {"DYNMO_COSTS": "0:1,4,4,4,4,3;3:1,14,4,4,4,3"}


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory, request):
    """One tokenizer cache per test session, shared with the torchrun subprocesses and, under
    pytest-xdist, among its workers (their base folders sit side by side; dynmo.data writes the
    cache by atomic renames, so workers preparing one corpus at once do not collide)."""
    if "DYNMO_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        cache = (base.parent if hasattr(request.config, "workerinput") else base) / "dynmo-cache"
        cache.mkdir(exist_ok=True)
        os.environ["DYNMO_CACHE"] = str(cache)
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
        # Without written bytecode every process a test starts compiles dynmo's sources again (a
        # launch's launcher, agent and fork server: about 0.4 s of CPU); they share one cache for
        # the session instead, outside the checkout.
        base = tmp_path_factory.getbasetemp()
        os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = str((base.parent if hasattr(request.config, "workerinput") else base)
                                                / "pycache")
    yield


# Failures of the launcher or of gloo's sockets on a loaded machine, not of dynmo.
TRANSIENT = re.compile(r"Address already in use|EADDRINUSE|Connection reset by peer|Connection refused|"
                       r"RendezvousConnectionError|RendezvousTimeoutError|Socket Timeout")


def load_benchmark(name: str):
    """The script benchmarks/NAME.py as a module (registered, so its dataclasses find their module)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_train(out: Path, *args: str, nproc: int = 2, timeout: int = 300, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`dynmo train` on the tiny model; `env` adds variables (the test injections of
    dynmo.runtime.faults, e.g. DYNMO_COSTS)."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--out", str(out), *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    fresh = not Path(out).exists() or not any(Path(out).iterdir())
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 and TRANSIENT.search(p.stderr):
        print(f"transient launcher failure, retrying once:\n{p.stderr[-2000:]}", file=sys.stderr)
        if fresh and Path(out).is_dir():
            shutil.rmtree(out)  # what the failed attempt wrote; a new run refuses a non-empty folder
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"dynmo train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


# What the processes of `spawn` import before they fork: a fresh interpreter per process would
# import torch again (seconds each); the fork server does it once per test session, and it has
# run no torch op, so no OpenMP thread pool is copied into a child.
SPAWN_PRELOAD = ["torch", "torch.distributed", "dynmo.model.layers", "dynmo.runtime.experts"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`, started from a fork server: each process runs
    fn(rank, *args) in a child of its own (gloo tests of a few processes)."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    multiprocessing.forkserver.set_forkserver_preload(SPAWN_PRELOAD)  # read when the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def param_counts(model: dict) -> list[int]:
    """Parameters per layer of the model a `[model]` config section (a dict) describes."""
    from dynmo.config import Config, apply_dict
    from dynmo.model.layers import layer_param_counts

    cfg = Config()
    apply_dict(cfg, {"model": model})
    return layer_param_counts(cfg.model)


# ---- order: the longest tests first ---------------------------------------------------------

# Seconds (setup, call and teardown) each of the suite's longest tests took in a full run of the
# CI command with --durations=0 on 2 busy cores (README.md, "Install and run the tests"): what
# counts is their order, never a limit. A test missing here (new, renamed) runs in collection
# order among the short ones; a stale figure costs only time.
LONGEST: dict[str, float] = {
    'tests/test_expert_parallel.py::test_gpt_moe_trains_as_without_expert_parallelism_and_resumes_under_another': 169,
    'tests/test_shard.py::test_sharded_state_trains_as_unsharded_migrates_repacks_and_reshards_on_load': 161,
    'tests/test_expert_parallel.py::test_mixtral_trains_as_without_expert_parallelism_migrates_and_exports': 149,
    'tests/test_failures.py::test_elastic_restart_on_the_surviving_agent': 122,
    'tests/test_dyn_prune.py::test_structured_pruning_shrinks_blocks_globally_and_migrates_them_exactly': 98,
    'tests/test_units.py::test_a_sublayer_checkpoint_resumes_on_whole_blocks_and_back': 81,
    'tests/test_hf.py::test_train_with_lr_0_then_export_gives_the_checkpoint_back[llama]': 80,
    'tests/test_bad_input.py::test_checkpoint_of_a_different_model_shape': 77,
    'tests/test_units.py::test_dynamic_cases_on_half_blocks_train_bitwise_as_on_whole_blocks[earlyexit+pruning]': 75,
    'tests/test_balance_optimal.py::test_identical_stage_fast_path_matches_general_path': 74,
    'tests/test_dyn_prune.py::test_distributed_pruning_mask_is_global_unstructured_and_survives_training_and_migration': 71,
    'tests/test_units.py::test_dynamic_cases_on_half_blocks_train_bitwise_as_on_whole_blocks[mod+structured-pruning]': 67,
    'tests/test_expert_replacement.py::test_a_run_with_experts_moved_trains_bitwise_as_without_and_resumes_with_its_placement': 66,
    'tests/test_dyn_prune.py::test_distributed_floored_masks_are_the_single_process_reference_on_any_layout_and_rank_count': 64,
    'tests/test_grow.py::test_the_controller_repacks_then_takes_the_workers_back_with_the_losses_of_an_uninterrupted_run': 64,
    'tests/test_dyn_earlyexit.py::test_resume_restores_the_exit_classifiers': 63,
    'tests/test_failures.py::test_a_hung_rank_ends_the_job_naming_it': 59,
    'tests/test_compile.py::test_launcher_trains_compiled_through_a_migration': 57,
    'tests/test_hf.py::test_after_training_the_exported_model_gives_dynmos_validation_loss[mixtral]': 53,
    'tests/test_repack.py::test_controller_repacks_two_ranks_to_one_once_the_model_shrank': 51,
    'tests/test_llama_dynamic.py::test_llama_variants_train_report_stats_and_survive_a_relayout[earlyexit]': 49,
    'tests/test_pipeline_dist.py::test_checkpoint_resumes_under_another_layout_and_stage_count': 49,
    'tests/test_bad_input.py::test_torchrun_entry_rejects_bad_input_without_hanging': 45,
    'tests/test_bad_input.py::test_checkpoint_at_train_steps_trains_nothing_and_succeeds': 44,
    'tests/test_repack.py::test_checkpoint_after_a_repack_resumes_on_fewer_ranks': 44,
    'tests/test_worker_errors.py::test_a_shard_damaged_inside_is_refused_by_the_worker_leaving_the_folder_as_it_was': 42,
    'tests/test_data_batches.py::test_training_on_a_blend_resumes_onto_the_same_windows': 42,
    'tests/test_units.py::test_halves_freeze_front_to_back_and_a_move_changes_nothing': 42,
    'tests/test_dyn_freeze.py::test_resume_keeps_frozen_blocks_frozen_and_the_trajectory': 42,
    'tests/test_cut_bytes.py::test_optimal_with_cut_factors_matches_brute_force_with_fewest_moves': 41,
    'tests/test_noise.py::test_noise_changes_no_loss_and_reports_the_extra_work_per_layer': 41,
    'tests/test_worker_errors.py::test_an_unexpected_exception_shows_its_traceback_once': 41,
    'tests/test_controller.py::test_skewed_model_is_rebalanced_within_a_window_trains_the_same_and_its_trace_replays_the_move': 40,
    'tests/test_controller.py::test_auto_does_not_migrate_a_balanced_model_under_noise': 40,
    'tests/test_worker_errors.py::test_resume_latest_falls_back_past_a_truncated_shard_and_finishes': 39,
    'tests/test_llama_dynamic.py::test_llama_variants_train_report_stats_and_survive_a_relayout[mod]': 38,
    'tests/test_balance_optimal.py::test_optimal_matches_brute_force_with_fewest_moves': 38,
    'tests/test_numerics.py::test_bf16_trains_and_relayouts_keep_its_trajectory_bitwise': 37,
    'tests/test_hf.py::test_export_bad_input_is_one_line_and_status_2': 37,
    'tests/test_llama_dynamic.py::test_llama_variants_train_report_stats_and_survive_a_relayout[hashattn]': 36,
    'tests/test_controller_evidence.py::test_a_lower_confidence_and_no_floor_do_move_for_noise': 36,
    'tests/test_bench.py::test_moe_cases_are_replayed_with_expert_parallelism_and_the_rows_kept': 36,
    'tests/test_dyn_freeze.py::test_frozen_blocks_never_change_skip_weight_grads_and_stay_frozen_after_migration': 35,
    'tests/test_worker_errors.py::test_a_truncated_shard_named_explicitly_is_refused_before_launch': 35,
    'tests/test_families.py::test_forced_relayouts_keep_the_mixtral_loss_trajectory_bitwise': 34,
    'tests/test_link_delay.py::test_a_link_delay_changes_no_number_of_the_training': 33,
    'tests/test_dyn_earlyexit.py::test_later_blocks_process_fewer_tokens_end_to_end_and_after_migration': 32,
    'tests/test_tied.py::test_a_two_rank_checkpoint_resumes_on_one_rank': 31,
    'tests/test_tensor_cluster.py::test_a_task_that_kills_every_worker_is_one_line': 31,
    'tests/test_dyn_freeze.py::test_zero_bubble_schedule_trains_with_frozen_blocks[zbv]': 31,
    'tests/test_expert_replacement.py::test_moving_experts_carries_their_weights_gradients_and_adamw_state[4-0]': 30,
    'tests/test_bench.py::test_no_real_keeps_the_real_rows_and_compares_with_the_dense_trace_at_paper_scale': 30,
    'tests/test_hf.py::test_train_with_lr_0_then_export_gives_the_checkpoint_back[mixtral]': 30,
    'tests/test_dyn_e2e.py::test_aux_losses_under_zero_bubble_schedules_match_reference[block_args0-interleavedzb-extra0]': 30,
    'tests/test_tensor_dataset.py::test_siblings_of_real_tensors_join_the_grid': 29,
    'tests/test_worker_errors.py::test_a_long_temporary_folder_path_still_launches': 29,
    'tests/test_dyn_e2e.py::test_mod_per_block_capacity_sets_the_work_and_the_measured_time': 28,
    'tests/test_cut_bytes.py::test_a_sublayer_early_exit_run_records_its_cut_bytes': 27,
    'tests/test_compile.py::test_checkpointed_compiled_units_equal_eager_and_count_one_forward[gpt-hashattn]': 27,
    'tests/test_pipeline_dist.py::test_forced_relayouts_leave_training_unchanged': 26,
    'tests/test_pipeline_dist.py::test_two_rank_pipeline_equals_single_process[gpipe]': 26,
    'tests/test_units.py::test_sublayer_units_train_bitwise_as_the_single_model_through_relayouts_that_split_blocks[hashattn]': 25,
    'tests/test_units.py::test_sublayer_units_train_bitwise_as_the_single_model_through_relayouts_that_split_blocks[gpt]': 25,
}


def _shares_a_fixture(item) -> str | None:
    """The module of `item` when it uses a module- or class-scoped fixture (set up once per module
    and worker: its tests stay together so the fixture is not set up again), else None."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope in ("module", "class", "package") for ds in defs.values() for d in ds):
        return item.nodeid.split("::")[0]
    return None


def longest_first(items: list, workers: int, seconds: dict[str, float]) -> list:
    """`items` reordered so the long ones start first on every worker. pytest-xdist's worksteal
    hands worker i the next len(left) // (workers - i) items in order, then idle workers steal
    the back half of the longest queue: so each of those first chunks starts with its share of
    the long tests, shared out longest first to the chunk with the fewest seconds so far
    (greedy), and ends with short ones, which are what gets stolen. A run that ended with one
    long test alone on a worker while the others idle takes that test's time longer."""
    blocks: dict[str, list] = {}
    for item in items:
        blocks.setdefault(_shares_a_fixture(item) or item.nodeid, []).append(item)
    cost = {k: sum(seconds.get(i.nodeid, 0.0) for i in b) for k, b in blocks.items()}
    long = sorted((k for k in blocks if cost[k] > 0), key=lambda k: -cost[k])  # stable: ties in order
    short = [i for k, b in blocks.items() if cost[k] == 0 for i in b]
    workers = max(1, workers)
    sizes, left = [], len(items)
    for w in range(workers):
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    heads: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for k in long:
        w = min(range(workers), key=lambda w: load[w])
        heads[w] += blocks[k]
        load[w] += cost[k]
    out, at = [], 0
    for w in range(workers):
        n = max(0, sizes[w] - len(heads[w]))
        out += heads[w] + short[at:at + n]
        at += n
    return out + short[at:]


def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = longest_first(items, workers, LONGEST)

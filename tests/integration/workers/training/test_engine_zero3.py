"""ZeRO-3 and offload keep the promise: a resumed run is bitwise the uninterrupted one.

Real DeepSpeed on CPU (gloo), no mocks. Stage-3 files differ from ZeRO 0-2 (every rank writes its
own model file of placeholders next to its optimizer shard, which holds the rank's fp32 partition
of every parameter), so this file also covers what depends on the layout: the files a committed
state must list, the digest and the export (both gather the partitions), the weights-only load
of stage-3 shards (a planted payload is refused and the run falls back), and the sealed
universal-checkpoint loaders. The stage-3 rows of the general grids live in
tests/integration/workers/training/test_loop_exact_resume.py and tests/integration/workers/state/test_saving_phases.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from syncpoint.policies.contracts.errors import SpecError
from syncpoint.policies.contracts.state_format import required_files
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.zero3_consolidate import consolidate_zero3
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import committed_steps, digest, lm_spec, run, run_until_crash, state_names, with_overrides
from tests.integration.workers.integrity.test_safe_load_trust_load import one_paragraph, payload, plant
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run, module_params

SAVE = "{value: 3, unit: micro_steps}"
MODEL0 = "engine/zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM0 = "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _spec(tmp, zero=3, *extra, workers=1):
    return lm_spec(
        tmp,
        f"task.config.num_samples={20 * workers}",
        "train.grad_accum=4",
        "train.epochs=2",
        f"checkpoint.save_every={SAVE}",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def _crash_and_resume(ref, tmp, crash_at: int, *extra: str):
    """Run ``ref``'s spec (plus ``extra``) in a fresh directory, crash after ``crash_at``, resume."""
    spec = with_overrides(ref, f"storage={tmp}", *extra, f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]")
    assert run_until_crash(spec)
    return spec, run(spec)


def test_required_files_at_stage_3_name_every_ranks_model_and_optimizer_file():
    assert required_files(world_size=2, zero_stage=3, precision="fp32", full_optimizer_state=False) == [
        "trainer.json",
        "engine/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "engine/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "rng/rank_00000.safetensors",
        "rng/rank_00001.safetensors",
    ]
    bf16 = required_files(world_size=1, zero_stage=3, precision="bf16", full_optimizer_state=True)
    assert "engine/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in bf16 and "optim/full.safetensors" in bf16
    assert "engine/mp_rank_00_model_states.pt" not in bf16


@pytest.mark.parametrize(
    "override,message",
    [
        ("deepspeed.offload_params=cpu", "offload_params needs deepspeed.zero_stage: 3"),
        ("deepspeed.offload_optimizer=cpu", "offload_optimizer needs deepspeed.zero_stage 1, 2 or 3"),
        ("deepspeed.offload_optimizer=nvme", "offload_optimizer"),
    ],
)
def test_offload_combinations_are_refused_at_validation(tmp_path, override, message):
    stage = "deepspeed.zero_stage=2" if "params" in override else "deepspeed.zero_stage=0"
    with pytest.raises(SpecError, match=message):
        lm_spec(tmp_path, stage, override)


@pytest.mark.slow
def test_zero3_resume_digest_export_and_planted_payload(tmp_path):
    """One stage-3 run serves four checks (each stage-3 run costs a minute on this machine):
    crash + resume equals the uninterrupted run (losses, LRs, every gathered parameter, digest);
    the export is the gathered model, not the rank-local shard; and a planted payload in a stage-3
    model file or optimizer shard is refused weights-only (no code runs) and the run falls back."""
    ref = _spec(tmp_path / "ref", 3, "checkpoint.export_final=true")
    ref_final = run(ref).final_state
    spec, result = _crash_and_resume(ref, tmp_path / "run", 13)
    assert_same_run(ref, ref_final, spec, result.final_state)

    exported = load_file(str(tmp_path / "ref" / ref.name / "final" / "model.safetensors"))
    gathered = module_params(ref, ref_final)
    assert exported.keys() == gathered.keys()
    assert all(torch.equal(exported[k], gathered[k]) for k in gathered)
    assert exported["embed.weight"].shape == (48, 16)  # the whole parameter, not a placeholder

    marker = tmp_path / "marker"
    store = RunStorage(spec.run_url)
    states = committed_steps(spec)
    newest, older = f"{states[-1]:012d}", f"{states[-2]:012d}"
    for rel in (MODEL0, OPTIM0):
        plant(store, newest, rel, payload(marker, "zip"))
    resumed = run(with_overrides(spec, "faults=[]"))
    assert not marker.exists()
    assert resumed.resumed_from == older
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    reason = {c["state"]: c["reason"] for c in decision["candidates"]}[newest]
    assert "needs class" in reason and "refused (corrupt)" in reason, reason
    one_paragraph(reason)


def test_consolidate_zero3_puts_padded_partitions_together():
    """The layout the digest and the export read: rank r holds [r*p, (r+1)*p) of each parameter,
    the last partition zero-padded (5 elements on 2 ranks: 3 + 2 and a pad)."""
    a, b = torch.arange(5.0), torch.arange(6.0).view(2, 3) + 10
    flats = [torch.cat([a[:3], b.view(-1)[:3]]), torch.cat([a[3:], torch.zeros(1), b.view(-1)[3:]])]
    shapes = [{"a": torch.Size([5]), "b": torch.Size([2, 3])}]
    files = {}
    for r in range(2):
        files[f"engine/zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = {
            "module": {"a": torch.empty(0), "b": torch.empty(0), "buf": torch.ones(2)},
            "param_shapes": shapes,
        }
        files[f"engine/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] = {
            "optimizer_state_dict": {"fp32_flat_groups": [flats[r]]}
        }
    out = consolidate_zero3(list(files), files.__getitem__)
    assert list(out) == ["a", "b", "buf"]
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and torch.equal(out["buf"], torch.ones(2))


LONG = pytest.mark.long


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero,offload_params",
    [
        pytest.param(1, "none", marks=LONG),
        pytest.param(2, "none", marks=LONG),
        pytest.param(3, "none", marks=LONG),
        (3, "cpu"),
    ],
)
def test_offload_resume_equals_uninterrupted(tmp_path, zero, offload_params):
    """Optimizer offload (DeepSpeed's CPU Adam; its op is JIT-built once) at every stage that has
    it, and parameter offload at stage 3: the resumed run is bitwise the uninterrupted one."""
    extra = ("deepspeed.offload_optimizer=cpu", f"deepspeed.offload_params={offload_params}")
    ref = _spec(tmp_path / "ref", zero, *extra)
    ref_final = run(ref).final_state
    spec, result = _crash_and_resume(ref, tmp_path / "run", 9)
    assert_same_run(ref, ref_final, spec, result.final_state)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        # make test: the same crash and resume of two stage-3 ranks on S3 (the test below)
        pytest.param((), marks=pytest.mark.long),
        pytest.param(("deepspeed.offload_optimizer=cpu", "deepspeed.offload_params=cpu"), marks=pytest.mark.long),
    ],
    ids=["zero3", "zero3-offload"],
)
def test_two_ranks_zero3_hard_crash_resume_equals_uninterrupted(tmp_path, extra):
    """Two spawned ranks, each holding half of every parameter; rank 1 dies hard mid-cycle."""
    ref = _spec(tmp_path / "ref", 3, *extra, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = max(state_names(ref))
    spec = _spec(tmp_path / "run", 3, *extra, "faults=[{rank: 1, at_micro_step: 13}]", workers=2)
    assert run_spawned(spec)[1] == 17
    newest = max(state_names(spec))
    assert newest < ref_final
    assert run_spawned(spec) == [0, 0]
    assert _resume_decision(spec)["chosen"] == newest  # loaded from each rank's own files, not refused
    assert_same_run(ref, ref_final, spec, max(state_names(spec)))
    assert digest(spec, ref_final) == digest(ref, ref_final)


def _resume_decision(spec) -> dict:
    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"][-1]


def test_two_ranks_zero3_on_s3_restore_from_their_own_files(s3, tmp_path):
    """On an object store each rank downloads only its own ZeRO-3 files (its module partition and
    optimizer shard, ``own_shard``): DeepSpeed loads from them, the newest state is the one resumed
    (a load that needed another rank's file would refuse it), and the run ends bitwise as uninterrupted."""
    from tests.s3_server import BUCKET

    ref = _spec(tmp_path / "ref", 3, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = max(state_names(ref))
    spec = _spec(
        f"s3://{BUCKET}/zero3-own",
        3,
        "checkpoint.memory_copy=false",
        "faults=[{rank: 1, at_micro_step: 13}]",
        workers=2,
    )
    assert run_spawned(spec)[1] == 17
    newest = max(state_names(spec))
    assert run_spawned(with_overrides(spec, "faults=[]")) == [0, 0]
    assert _resume_decision(spec)["chosen"] == newest
    assert digest(spec, ref_final) == digest(ref, ref_final)


def test_zero3_module_only_load_goes_through_the_weights_only_loader(tmp_path):
    """DeepSpeed's ZeRO-3 module-only load (init_from without the optimizer, reset_optimizer) calls
    ``get_fp32_state_dict_from_zero_checkpoint``, which unpickles with weights_only=False: after
    ``route_zero3_module_load`` the name DeepSpeed calls refuses a planted payload, runs nothing,
    and still consolidates real partitions; the universal-checkpoint loaders are sealed."""
    import deepspeed.runtime.engine as ds_engine

    from syncpoint.policies.contracts.errors import StateRefused
    from syncpoint.workers.state.checkpoint_engine import route_zero3_module_load, seal_unsafe_loaders

    route_zero3_module_load()
    load = ds_engine.get_fp32_state_dict_from_zero_checkpoint
    engine_dir = tmp_path / "state" / "engine"
    engine_dir.mkdir(parents=True)
    shapes = [{"w": torch.Size([3])}]
    torch.save({"module": {"w": torch.empty(0)}, "param_shapes": shapes}, engine_dir / MODEL0.split("/")[1])
    torch.save(
        {"optimizer_state_dict": {"fp32_flat_groups": [torch.tensor([1.0, 2.0, 3.0])]}},
        engine_dir / OPTIM0.split("/")[1],
    )
    assert torch.equal(load(str(tmp_path / "state"))["w"], torch.tensor([1.0, 2.0, 3.0]))
    marker = tmp_path / "marker"
    (engine_dir / OPTIM0.split("/")[1]).write_bytes(payload(marker, "zip"))
    (tmp_path / "state" / "latest").write_text("engine")
    with pytest.raises(StateRefused, match="needs class"):
        load(str(tmp_path / "state"))
    assert not marker.exists()

    class Optimizer:
        def load_hp_checkpoint_state(self, *_):
            raise AssertionError("reached DeepSpeed's own loader")

    opt = Optimizer()
    assert seal_unsafe_loaders(opt) == ["load_hp_checkpoint_state"]
    with pytest.raises(Exception, match="weights_only=False"):
        opt.load_hp_checkpoint_state("folder", "fp32")


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["shrink", pytest.param("grow", marks=pytest.mark.long)])
def test_elastic_zero3_across_world_sizes(tmp_path, direction):
    """Stage 3 as 1/2: the gathered optimizer state is scattered into the other world size's
    partitions; the same samples per step, losses within 1e-3, weights within 2 x sum(lr)."""
    from tests.integration.policies.decisions.test_elastic import _assert_same_samples_and_close
    from tests.integration.policies.decisions.test_elastic import _spec as elastic_spec

    ref = elastic_spec(tmp_path / "ref", "deepspeed.zero_stage=3")
    assert run_spawned(ref) == [0, 0]
    if direction == "shrink":
        spec = elastic_spec(tmp_path / "run", "deepspeed.zero_stage=3", "faults=[{rank: 1, at_micro_step: 13}]")
        assert run_spawned(spec)[1] == 17
        assert run_spawned(spec, world_size=1) == [0]
    else:
        spec = elastic_spec(tmp_path / "run", "deepspeed.zero_stage=3", "faults=[{rank: 0, at_micro_step: 11}]")
        assert run_spawned(spec, world_size=1) == [17]
        assert run_spawned(spec) == [0, 0]
    _assert_same_samples_and_close(ref, spec)


@pytest.mark.slow
def test_the_digest_of_a_two_rank_zero3_state_ignores_the_uninitialised_padding(tmp_path):
    """DeepSpeed pads each parameter's partition to the world size and never initialises the fp32
    padding (``linear``'s 1-element output bias leaves rank 1 one padded element per group): two
    bitwise-equal runs differ there, so the digest hashes real elements only. A real element still counts."""
    import json

    import torch

    from syncpoint.workers.integrity.checksum import checksum_bytes
    from syncpoint.workers.integrity.safe_load import load_state_file
    from tests.helpers import linear_spec

    spec = linear_spec(
        tmp_path, "deepspeed.zero_stage=3", "task.config.num_samples=16", "train.grad_accum=2", workers=2
    )
    assert run_spawned(spec) == [0, 0]
    name = max(state_names(spec))
    store, shard = RunStorage(spec.run_url), "engine/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    before = digest(spec, name)

    def rewrite(edit) -> str:
        sd = load_state_file(store.local_path("states", name, shard), shard)
        edit(sd["optimizer_state_dict"])
        torch.save(sd, store.local_path("states", name, shard))
        with open(store.local_path("states", name, shard), "rb") as f:
            data = f.read()
        with open(store.local_path("states", name, "manifest.json"), "rb") as f:
            manifest = json.loads(f.read())
        manifest["files"][shard] = {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
        store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")
        return digest(spec, name)

    def garbage_in_padding(osd):  # group 1 is [0.bias (4 of 8 on rank 1), 2.bias (0 of 1: padding)]
        osd["fp32_flat_groups"][1].data[-1] = 1.2e28
        osd["optimizer_state_dict"]["state"][1]["exp_avg"][-1] = -3.0

    def a_real_change(osd):
        osd["fp32_flat_groups"][1].data[0] += 1.0

    assert rewrite(garbage_in_padding) == before
    assert rewrite(a_real_change) != before

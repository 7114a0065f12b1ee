"""SGLang's own pieces that the backend's messages go through: its SamplingParams, its
serializer and SafeUnpickler (in a spawned process, as its scheduler unpickles), its request
structs, and what its CUDA-only reduction patch does to CPU tensors."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minippo.engine import SamplingParams as Ours
from minippo.engine.sglang_engine import serialize_bucket, sglang_sampling_params
from minippo.models import Transformer, init_weights
from minippo.parallel import full_tensor_buckets
from tests.sglang_cpu.conftest import ARGS
from tests.sglang_pieces import STRUCTS

pytestmark = pytest.mark.sglang_cpu

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    """``code`` in a fresh interpreter (SGLang's patches are process-wide); its RESULT line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("SGLANG_USE_CPU_ENGINE", None)  # set here by the CPU engines of earlier tests
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.parametrize(
    "ours",
    [
        Ours(),
        Ours(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9, stop_token_ids=(2, 3), seed=7),
        Ours(temperature=0.0, seed=3, max_new_tokens=4),
    ],
    ids=["defaults", "filtered-with-stops", "greedy"],
)
@pytest.mark.parametrize("send_seed", [True, False])
def test_sampling_dicts_through_sglang_sampling_params(ours, send_seed):
    """Our request's sampling dict is what SGLang's SamplingParams reads: greedy rewritten to
    T = 1, top_k = 1; top_k 0 = the whole vocabulary; no stop ids = ignore_eos; the seed only
    when sent (deterministic mode) and never for greedy requests."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams

    sp = SamplingParams(**sglang_sampling_params(ours, send_seed=send_seed))
    sp.verify(vocab_size=1000)
    if ours.temperature == 0.0:
        assert (sp.temperature, sp.top_k) == (1.0, 1)
    else:
        assert sp.temperature == ours.temperature and sp.top_p == ours.top_p
        assert sp.top_k == ours.top_k or (ours.top_k == 0 and sp.top_k == TOP_K_ALL)
    assert sp.max_new_tokens == ours.max_new_tokens
    assert sorted(sp.stop_token_ids or []) == sorted(ours.stop_token_ids)
    assert sp.ignore_eos == (not ours.stop_token_ids)
    sent = send_seed and ours.seed is not None and ours.temperature > 0
    assert sp.sampling_seed == (ours.seed if sent else None)


def _summary(named) -> list:
    return [
        [n, str(t.dtype), list(t.shape), t.double().sum().item(), t.flatten()[:5].tolist()]
        for n, t in named
    ]


def _unpickle_in_child(payload: bytes, conn) -> None:
    """A spawned child of the test process, as SGLang's scheduler is of the trainer's."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    conn.send(_summary(MultiprocessingSerializer.deserialize(payload)))
    conn.close()


def test_a_cpu_bucket_is_unpickled_by_sglang_in_a_spawned_process():
    """A CPU engine's bucket, serialised as the backend does (SGLang's MultiprocessingSerializer,
    without the CUDA reduction patch), is what SGLang's SafeUnpickler gives its scheduler in a
    spawned process: names, dtypes, shapes and values. SafeUnpickler refuses a code global."""
    import multiprocessing

    from sglang.srt.utils.common import MultiprocessingSerializer

    from minippo.engine.sglang_engine import _load_sglang_api

    model = init_weights(Transformer(ARGS), seed=1, std=0.1)
    named = [x for b in full_tensor_buckets(model, bucket_bytes=1 << 30) for x in b]
    payload = serialize_bucket(_load_sglang_api(), named, cuda=False)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_unpickle_in_child, args=(payload, there))
    child.start()
    try:
        assert here.poll(300), "the spawned process did not answer"
        got = here.recv()
    finally:
        child.join(60)
    assert got == _summary(named)
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        MultiprocessingSerializer.deserialize(pickle.dumps(os.system))


def test_sglangs_cuda_reduction_patch_breaks_cpu_pickling():
    """Why a CPU engine's buckets go without SGLang's producer-side patch: once applied (process
    wide), pickling a CPU tensor with ForkingPickler fails."""
    got = _run(
        """
        import json, torch
        from sglang.srt.utils import patch_torch
        from sglang.srt.utils.common import MultiprocessingSerializer
        from torch.multiprocessing import reductions
        patch_torch.monkey_patch_torch_reductions()
        try:
            MultiprocessingSerializer.serialize(obj=[("w", torch.ones(3))])
            error = None
        except Exception as e:
            error = type(e).__name__
        print("RESULT " + json.dumps({"reduce": reductions.reduce_tensor.__name__,
                                      "error": error}), flush=True)
        """
    )
    assert got == {"reduce": "_reduce_tensor_modified", "error": "IndexError"}


def test_the_backend_builds_sglangs_own_request_structs():
    """Every control call of the backend (pause, continue, weight-update session, version,
    memory release / resume) builds SGLang's real io_struct classes, and a publish through
    SGLang's real serializer reaches the model bit for bit (the stand-in's scheduler, with the
    real structs and serializer in place of its own)."""
    got = _run(
        """
        import json
        from sglang.srt.managers import io_struct
        from sglang.srt.utils.common import MultiprocessingSerializer
        import tests.unit.test_sglang_engine as stand_in
        from tests.sglang_pieces import STRUCTS
        structs = {name: getattr(io_struct, name) for name in STRUCTS}
        print("RESULT " + json.dumps(stand_in.run_with_real_pieces(
            structs, MultiprocessingSerializer)), flush=True)
        """
    )
    built = {n for n in STRUCTS if n.endswith("ReqInput")}  # BaseReq, FlushCacheReqOutput: not
    assert set(got["structs"]) == {f"sglang.srt.managers.io_struct.{n}" for n in built}
    assert got["versions"] == [[0] * 4, [2] * 4]
    assert got["weights_bit_exact"]
    assert got["calls"].count("begin_weight_update") == 3

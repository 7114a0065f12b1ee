"""SGLang's own code, run on CPU against the backend (marker ``network``: the pinned wheel and a
few small packages come from the package registry; skipped with pip's reason when offline).

One child process (tests/sglang_pieces.py) really imports, from a side folder, the pure-Python
pieces of sglang 0.5.23 that import on CPU, and runs:
    * our sampling dicts through SGLang's own ``SamplingParams`` (construction, defaults, verify);
    * a publish payload, serialised as the backend does, unpickled by SGLang's own
      ``MultiprocessingSerializer`` / ``SafeUnpickler`` in a *spawned* process, compared bit for
      bit; the allow-list; what the real producer-side reduction patch does;
    * the backend against the recording stand-in with SGLang's real request structs (executed
      from io_struct's source, which does not import on CPU) and its real serializer in the
      stand-in's scheduler.
"""

from __future__ import annotations

import pytest

from tests import sglang_pieces

pytestmark = pytest.mark.network

IMPORTED_ON_CPU = (
    "sglang.srt.sampling.sampling_params",
    "sglang.srt.utils.msgspec_utils",
    "sglang.srt.utils.common",
    "sglang.srt.utils.patch_torch",
)


@pytest.fixture(scope="module")
def report() -> dict:
    try:
        sglang_pieces.side_folder()
    except RuntimeError as e:
        pytest.skip(str(e))
    return sglang_pieces.run_real("all")


def test_what_imports_on_cpu(report):
    imports = report["imports"]
    for name in IMPORTED_ON_CPU:
        assert imports[name] == "imported", f"{name}: {imports[name]}"
    # documented in tests/sglang_pieces.py and docs/sglang_backend.md: if this ever imports,
    # build the request structs from the real module instead of from its source
    assert imports["sglang.srt.managers.io_struct"] != "imported"


def test_sampling_dicts_through_sglang_sampling_params(report):
    by_case = {(str(c["ours"]), c["send_seed"]): c for c in report["sampling"]}
    for c in by_case.values():
        ours = c["ours"]
        if ours["temperature"] == 0.0:  # SGLang's greedy rewrite
            assert (c["temperature"], c["top_k"]) == (1.0, 1)
        else:
            assert c["temperature"] == ours["temperature"] and c["top_p"] == ours["top_p"]
            assert c["top_k"] == ours["top_k"] or (ours["top_k"] == 0 and c["top_k_is_all"])
        assert c["max_new_tokens"] == ours["max_new_tokens"]
        assert c["stop_token_ids"] == sorted(ours["stop_token_ids"])
        assert c["ignore_eos"] == (not ours["stop_token_ids"])  # no stop ids: nothing stops it
        sent = c["send_seed"] and ours["seed"] is not None and ours["temperature"] > 0
        assert c["sampling_seed"] == (ours["seed"] if sent else None)


def test_payload_unpickled_by_sglang_in_a_spawned_process(report):
    w = report["weights"]
    assert "error" not in w["spawned"], w["spawned"]
    assert w["spawned"]["unpickler"] == "sglang.srt.utils.common"
    assert w["spawned"]["digests"] == w["digests"]  # bit-exact, names, dtypes and shapes
    assert w["n_tensors"] == len(w["digests"]) > 0
    assert w["rebuild_cuda_tensor_modified_allowed"] and w["rebuild_cuda_tensor_allowed"]
    assert w["blocks_os_system"]
    # the producer-side patch the backend applies: CUDA tensors only (CPU ones cannot be pickled
    # by ForkingPickler in that process any more; documented)
    assert w["patched_reduce_tensor"] == "_reduce_tensor_modified"
    assert w["patched_cpu_serialize"].startswith("IndexError")


def test_backend_builds_sglang_request_structs(report):
    b = report["backend"]
    io = "sglang.srt.managers.io_struct."
    assert set(b["structs"]) == {
        io + name
        for name in (
            "PauseGenerationReqInput",
            "ContinueGenerationReqInput",
            "BeginWeightUpdateReqInput",
            "EndWeightUpdateReqInput",
            "UpdateWeightsFromTensorReqInput",
            "UpdateWeightVersionReqInput",
            "ReleaseMemoryOccupationReqInput",
            "ResumeMemoryOccupationReqInput",
        )
    }
    assert b["versions"] == [[0] * 4, [2] * 4]
    assert b["weights_bit_exact"]  # what SGLang's SafeUnpickler gave the stand-in's model
    assert b["calls"].count("begin_weight_update") == 3

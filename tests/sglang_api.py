"""The SGLang API surface that minippo/engine/sglang_engine.py uses: ONE table.

tests/unit/test_sglang_api_compat.py checks every entry against the pinned wheel's source, and
checks that the backend's own calls into SGLang (``self._engine.X``, ``self._tm.X``,
``self._api.X``, imports, output keys) are all here. Update it together with the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from minippo.engine.sglang_engine import engine_server_args


@dataclass(frozen=True)
class ApiUse:
    """One piece of SGLang's API that this backend relies on.

    Fields:
        kind:     "class"       importable ``name`` from ``module``; ``keywords`` = constructor
                                keywords passed (each must be a field of the class);
                  "function"    importable module-level function ``name`` from ``module``, called
                                with ``keywords``;
                  "server_args" ``Engine(**kwargs)`` builds ``ServerArgs(**kwargs)``: ``keywords``
                                are the kwargs passed (each must be a ServerArgs field);
                  "method"      ``Class.method`` (resolved through base classes in the wheel);
                                ``keywords`` are the keyword arguments passed; ``is_async`` says
                                whether it is awaited;
                  "attribute"   ``Class.attr`` set on instances (``self.attr = ...``);
                  "literal"     strings that must occur in ``module`` as string constants or
                                as assigned / annotated names (output keys, literal values,
                                struct fields, environment settings).
        module:   dotted module path inside the wheel.
        name:     class, ``Class.member`` or a label (for literals).
        keywords: see ``kind``.
        is_async: for methods: True = ``async def`` (awaited), False = plain ``def``.
        note:     why the backend needs it.
    """

    kind: Literal["class", "function", "server_args", "method", "attribute", "literal"]
    module: str
    name: str
    keywords: tuple[str, ...] = ()
    is_async: bool | None = None
    note: str = ""


_ENGINE = "sglang.srt.entrypoints.engine"
_IO = "sglang.srt.managers.io_struct"
_TM = "sglang.srt.managers.tokenizer_manager"

# keys of the Engine(**kwargs) call, in the order engine_server_args() builds them (every one is
# passed whatever the values, so any valid arguments show them all)
SERVER_ARG_KEYS: tuple[str, ...] = tuple(
    engine_server_args(
        model_path="m",
        local_rank=0,
        port=30000,
        nccl_port=30001,
        mem_fraction_static=0.5,
        dtype="bfloat16",
        load_format="dummy",
        memory_mode="overlap",
        weights_cpu_backup=False,
        random_seed=0,
        version=0,
        context_length=None,
        sampling_backend=None,
        enable_deterministic_inference=False,
        rl_on_policy_target=None,
        log_level="error",
    )
)

SGLANG_API: tuple[ApiUse, ...] = (
    # -- imports and constructors
    ApiUse("class", _ENGINE, "Engine", note="one offline engine per rank: Engine(**server_args)"),
    ApiUse("server_args", "sglang.srt.server_args", "ServerArgs", SERVER_ARG_KEYS),
    ApiUse("class", "sglang.srt.utils", "MultiprocessingSerializer", note="CUDA IPC payloads"),
    ApiUse(
        "function",
        _ENGINE,
        "kill_process_tree",
        ("parent_pid", "include_parent", "wait_timeout"),
        note="what Engine.shutdown calls on every child of this process; the backend narrows it "
        "to the engine's own processes",
    ),
    ApiUse(
        "function",
        "sglang.srt.utils.patch_torch",
        "monkey_patch_torch_reductions",
        note="producer side: IPC handles carry the GPU's UUID, not this process's device index",
    ),
    ApiUse("class", _IO, "PauseGenerationReqInput", ("mode",)),
    ApiUse(
        "class",
        _IO,
        "ContinueGenerationReqInput",
        ("torch_empty_cache",),
        note="False: the engine keeps its cached blocks (the trainer shares the GPU)",
    ),
    ApiUse("class", _IO, "BeginWeightUpdateReqInput"),
    ApiUse("class", _IO, "EndWeightUpdateReqInput"),
    ApiUse(
        "class",
        _IO,
        "UpdateWeightsFromTensorReqInput",
        ("serialized_named_tensors", "load_format", "flush_cache"),
    ),
    ApiUse("class", _IO, "UpdateWeightVersionReqInput", ("new_version", "abort_all_requests")),
    ApiUse("class", _IO, "ReleaseMemoryOccupationReqInput", ("tags",)),
    ApiUse("class", _IO, "ResumeMemoryOccupationReqInput", ("tags",)),
    # -- Engine members
    ApiUse("attribute", _ENGINE, "Engine.tokenizer_manager", note="the async control API"),
    ApiUse("attribute", _ENGINE, "Engine.loop", note="the loop our thread runs"),
    ApiUse(
        "method",
        _ENGINE,
        "Engine.async_generate",
        ("input_ids", "sampling_params", "return_logprob", "rid"),
        is_async=True,
    ),
    ApiUse("method", _ENGINE, "Engine.shutdown", is_async=False),
    # -- tokenizer manager (methods live on TokenizerManager or its mixins)
    ApiUse("method", _TM, "TokenizerManager.pause_generation", ("obj",), is_async=True),
    ApiUse("method", _TM, "TokenizerManager.continue_generation", ("obj",), is_async=True),
    ApiUse(
        "method",
        _TM,
        "TokenizerManager.abort_request",
        ("rid", "abort_all"),
        is_async=False,
        note="abort_all: abort(); rid: one request of a stream (matched as a prefix of rids)",
    ),
    ApiUse("method", _TM, "TokenizerManager.begin_weight_update", ("obj", "request"), True),
    ApiUse("method", _TM, "TokenizerManager.end_weight_update", ("obj", "request"), True),
    ApiUse("method", _TM, "TokenizerManager.update_weights_from_tensor", ("obj", "request"), True),
    ApiUse("method", _TM, "TokenizerManager.flush_cache", (), is_async=True),
    ApiUse("method", _TM, "TokenizerManager.update_weight_version", ("obj",), is_async=True),
    ApiUse("method", _TM, "TokenizerManager.release_memory_occupation", ("obj", "request"), True),
    ApiUse("method", _TM, "TokenizerManager.resume_memory_occupation", ("obj", "request"), True),
    ApiUse("method", "sglang.srt.utils", "MultiprocessingSerializer.serialize", ("obj",), False),
    # -- output format and literal values
    ApiUse(
        "literal",
        _TM,
        "generate output",
        ("output_ids", "meta_info", "finish_reason", "output_token_logprobs", "weight_version"),
        note="the dict one request returns",
    ),
    ApiUse(
        "literal",
        "sglang.srt.utils.weight_versions",
        "per-token weight version spans",
        ("weight_versions", "version", "start", "end"),
    ),
    ApiUse(
        "literal",
        "sglang.srt.managers.schedule_batch",
        "finish reasons",
        ("type", "stop", "length", "abort"),
    ),
    ApiUse("literal", _IO, "pause modes", ("retract",)),
    ApiUse("literal", _IO, "FlushCacheReqOutput", ("success",), note="flush_cache() result"),
    ApiUse(
        "literal",
        "sglang.srt.sampling.sampling_params",
        "sampling parameter names",
        (
            "temperature",
            "top_p",
            "top_k",
            "max_new_tokens",
            "stop_token_ids",
            "ignore_eos",
            "sampling_seed",
        ),
    ),
    ApiUse(
        "literal",
        "sglang.srt.environ",
        "environment",
        ("SGLANG_RETURN_ORIGINAL_LOGPROB", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"),
        note="the first refused (T = 1 logprobs); the second set while the engine starts (the "
        "context it gets is the user's + CONTEXT_SLACK)",
    ),
    ApiUse(
        "literal",
        "sglang.srt.utils.common",
        "the CPU switch",
        ("SGLANG_USE_CPU_ENGINE",),
        note="set for engine.device=cpu before SGLang is imported",
    ),
    ApiUse(
        "literal",
        "sglang.srt.constants",
        "memory tags",
        ("weights", "kv_cache", "cuda_graph"),
    ),
)

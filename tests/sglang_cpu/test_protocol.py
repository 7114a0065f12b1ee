"""The engine protocol suite through SGLangEngine on the real SGLang engine (CPU, fp32).

One real engine serves the whole suite (starting one takes 10-40 s on 2 cores): each test gets a
view of it (:class:`FreshView`) whose versions count from the publish that started the test, so a
test sees what a fresh engine shows (version 0 holding ``weights(0)``), and its end leaves the
engine unpaused with nothing in flight. The view only renumbers versions; every call reaches the
backend and SGLang as it is.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minippo.engine import Completion
from minippo.engine.sglang_engine import SGLangEngine
from minippo.models import Transformer, init_weights
from tests.engine_suite import (
    EngineHarness,
    EngineProtocolSuite,
    one_torch_thread,  # noqa: F401 (autouse: one torch thread for this module)
    publish_model,
    reference_logprobs_of,
    req,
)
from tests.sglang_cpu.conftest import ARGS, next_base_port

pytestmark = pytest.mark.sglang_cpu

NOT_SEEDED = (
    "SGLang uses request seeds only with enable_deterministic_inference, which refuses the "
    "torch_native attention its CPU path needs"
)

_MODELS: dict[int, Transformer] = {}


def model_of(version: int) -> Transformer:
    if version not in _MODELS:
        _MODELS[version] = init_weights(Transformer(ARGS), seed=7000 + version, std=0.1).eval()
    return _MODELS[version]


def weights(version: int):
    from minippo.parallel import full_tensor_buckets

    return list(full_tensor_buckets(model_of(version), bucket_bytes=40_000))


# Tolerance of |engine logprob - trainer logprob| (both fp32, the same weights and tokens, other
# kernels and summation orders). A logit is the end of a chain of about C = 2 + 12 * n_layers
# fp32 operations (embedding, per block: 2 norms, 4 projections, RoPE, attention's two products
# and softmax, the MLP's 3 projections, the residual adds; final norm, lm_head), each a sum of at
# most K = max(dim, intermediate, seq) = 512 terms, whose rounding is at most K * u relative
# (u = 2^-24, the worst case of a sum in any order). With RMS-normalised activations and logits
# below Z = 5 in magnitude (these weights, std 0.1: the largest is about 4), the logit error is at
# most C * K * u * Z, and a logprob at temperature T moves by at most twice the largest logit error
# over T. Here: 2 * 26 * 512 * 6e-8 * 5 / 0.7 ≈ 1.1e-2 at T = 0.7 (the suite's smallest T above 0).
# A wrong temperature, weight or position moves logprobs by 0.1 or more.
LOGPROB_TOL = 2 * (2 + 12 * ARGS.n_layers) * 512 * 2.0**-24 * 5.0 / 0.7


class FreshView:
    """One test's engine: the shared SGLangEngine with versions counted from ``base``."""

    def __init__(self, engine: SGLangEngine) -> None:
        self._engine = engine
        self._base = engine.version + 1
        engine.publish_weights(weights(0), version=self._base)

    @property
    def version(self) -> int:
        return self._engine.version - self._base

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def max_batch_size(self) -> int | None:
        return self._engine.max_batch_size

    def _local(self, c: Completion) -> Completion:
        return dataclasses.replace(c, versions=[v - self._base for v in c.versions])

    def generate(self, requests):
        return [self._local(c) for c in self._engine.generate(requests)]

    def stream(self, requests, *, until_groups=None):
        inner = self._engine.stream(requests, until_groups=until_groups)  # validates now

        def local():
            try:
                for c in inner:
                    yield self._local(c)
            finally:
                inner.close()

        return local()

    def publish_weights(self, buckets, version: int) -> None:
        self._engine.publish_weights(buckets, version=self._base + version)

    def abort(self):
        return [self._local(c) for c in self._engine.abort()]

    def pause(self) -> None:
        self._engine.pause()

    def resume(self) -> None:
        self._engine.resume()

    def sleep(self) -> None:
        self._engine.sleep()

    def wake(self) -> None:
        self._engine.wake()

    def shutdown(self) -> None:
        """Leave the shared engine as the next test expects it: running, nothing in flight."""
        self._engine.resume()
        self._engine.abort()


@pytest.fixture(scope="module")
def shared_engine(model_path):
    engine = SGLangEngine(
        model_path,
        device="cpu",
        dtype="float32",
        model_args=ARGS,
        base_port=next_base_port(),
        call_timeout_s=120.0,
    )
    yield engine
    engine.shutdown()


class TestRealSGLangProtocol(EngineProtocolSuite):
    @pytest.fixture
    def harness(self, shared_engine):
        return EngineHarness(
            make_engine=lambda: FreshView(shared_engine),
            vocab_size=ARGS.vocab_size,
            max_seq_len=ARGS.max_seq_len,
            weights=weights,
            reference_logprobs=reference_logprobs_of(model_of),
            logprob_tol=LOGPROB_TOL,
            batch_invariant=False,
            long_tokens=400,
            exact_stops=False,
            mu_draws=1000,
            seeded=NOT_SEEDED,
        )


def test_greedy_after_a_publish_equals_torch_engine(shared_engine):
    """A publish through the backend's CPU path (serialised buckets, no CUDA IPC) reaches SGLang's
    model: greedy decoding then gives TorchEngine's tokens with the same weights, and the versions
    of the publish."""
    from minippo.engine.torch_engine import TorchEngine

    requests = [req([1, 2, 3], "a", temperature=0, max_new_tokens=24)]
    requests.append(req([5, 4], "b", temperature=0, max_new_tokens=17))
    view = FreshView(shared_engine)
    torch_engine = TorchEngine(ARGS, in_process=True)
    try:
        publish_model(view, model_of(3), version=1)
        publish_model(torch_engine, model_of(3), version=1)
        got = view.generate(requests)
        want = torch_engine.generate(requests)
    finally:
        torch_engine.shutdown()
        view.shutdown()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.versions for c in got] == [[1] * 24, [1] * 17]

"""The SGLang API the backend uses exists, with those names and keywords, in the pinned wheel.

Two halves:
    * against the wheel (marker ``network``): pip downloads sglang==SGLANG_VERSION (no install, no
      import; cached under ~/.cache/minippo/wheels, or $MINIPPO_CACHE/wheels), and every entry of
      ``SGLANG_API`` (tests/sglang_api.py) is checked in its source with ``ast``: import paths, ServerArgs fields for the
      ``Engine(**kwargs)`` call, constructor fields of the request structs, method names, keywords
      and sync/async, instance attributes, and output keys / literal values.
    * against the backend's own source (offline): every call the backend makes into SGLang
      (``self._engine.X(...)``, ``self._tm.X(...)``, ``self._api.X(...)``, imports, keys read from
      the outputs) is an entry of the table, with the same keywords, and every entry is used.
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import time
import zipfile
from functools import cache
from pathlib import Path

import pytest

import minippo.engine.sglang_engine as backend
from minippo.engine import SamplingParams
from minippo.engine.sglang_engine import SGLANG_VERSION
from tests.sglang_api import SERVER_ARG_KEYS, SGLANG_API, ApiUse

BACKEND_SOURCE = Path(backend.__file__)


def _cache_dir() -> Path:
    root = os.environ.get("MINIPPO_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "minippo") / "wheels"


def _download_wheel() -> Path:
    """The cached pinned wheel, downloading it on first use (pytest.skip when offline)."""
    cache_dir = _cache_dir()
    found = sorted(cache_dir.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"sglang=={SGLANG_VERSION}", "-d", str(cache_dir),
    ]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(
            f"cannot download sglang=={SGLANG_VERSION} (package registry unreachable?): {e}"
        )
    found = sorted(cache_dir.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        pytest.skip(
            f"cannot download sglang=={SGLANG_VERSION} with `{' '.join(cmd)}` "
            f"(offline, or no wheel for this platform): {' | '.join(tail)}"
        )
    print(f"downloaded {found[0].name} in {time.perf_counter() - t0:.1f} s")
    return found[0]


class WheelSource:
    """Reads modules of a wheel as ASTs (never imports them) and resolves names across imports."""

    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self.files = set(self.zip.namelist())
        self._trees: dict[str, ast.Module] = {}

    def path_of(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in self.files:
                return candidate
        return None

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.path_of(module)
            if path is None:
                raise LookupError(f"module {module} is not in the wheel")
            self._trees[module] = ast.parse(self.zip.read(path).decode("utf-8"), filename=path)
        return self._trees[module]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        is_pkg = (self.path_of(module) or "").endswith("__init__.py")
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def resolve(
        self, module: str, name: str, _seen: frozenset = frozenset()
    ) -> tuple[str, ast.AST]:
        """(defining module, definition node) of ``name`` as importable from ``module``."""
        if (module, name) in _seen:
            raise LookupError(f"import cycle resolving {module}.{name}")
        seen = _seen | {(module, name)}
        tree = self.tree(module)
        for node in tree.body:  # definitions first
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == name:
                    return module, node
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                    return module, node
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return module, node
        stars = []
        for node in ast.walk(tree):  # then imports (also inside try/if blocks)
            if isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name and source.startswith("sglang"):
                        return self.resolve(source, alias.name, seen)
        for source in stars:
            try:
                return self.resolve(source, name, seen)
            except LookupError:
                continue
        raise LookupError(f"{name} is not defined in or imported into {module}")

    def class_def(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        where, node = self.resolve(module, name)
        if not isinstance(node, ast.ClassDef):
            raise LookupError(f"{module}.{name} is not a class")
        return where, node

    def mro(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases defined in the wheel (depth first)."""
        out: list[tuple[str, ast.ClassDef]] = []
        stack = [self.class_def(module, name)]
        while stack:
            where, cls = stack.pop(0)
            if any(c is cls for _, c in out):
                continue
            out.append((where, cls))
            for base in cls.bases:
                # bases defined outside the wheel (msgspec.Struct, ABC, ...) are skipped
                if isinstance(base, ast.Name):
                    with contextlib.suppress(LookupError):
                        stack.append(self.class_def(where, base.id))
        return out

    def fields(self, module: str, name: str) -> set[str]:
        """Annotated class-level names of the class and its in-wheel bases (struct fields)."""
        return {
            node.target.id
            for _, cls in self.mro(module, name)
            for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }

    def method(self, module: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        cls_name, meth = qualname.split(".")
        for _, cls in self.mro(module, cls_name):
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == meth:
                    return node
        raise LookupError(f"{module}.{qualname} does not exist")

    def instance_attributes(self, module: str, cls_name: str) -> set[str]:
        names = set()
        for _, cls in self.mro(module, cls_name):
            for node in ast.walk(cls):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target]
                    if isinstance(node, ast.AnnAssign)
                    else []
                )
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                        if t.value.id == "self":
                            names.add(t.attr)
                    elif isinstance(t, ast.Name) and node in cls.body:
                        names.add(t.id)
        return names

    def words(self, module: str) -> set[str]:
        """String constants and assigned / annotated names (fields, settings) in ``module``."""
        out = set()
        for n in ast.walk(self.tree(module)):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                out.add(n.value)
            elif isinstance(n, ast.Assign):
                out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.add(n.target.id)
        return out

    def server_args_fields(self) -> set[str]:
        """ServerArgs' fields: its own annotations plus those of the namespaces it collects."""
        module = "sglang.srt.server_args"
        tree = self.tree(module)
        namespaces: list[str] = []
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets
            ):
                namespaces = [elt.id for elt in node.value.elts]  # type: ignore[attr-defined]
        assert namespaces, "ServerArgs no longer collects _INPUT_NAMESPACES; re-check the backend"
        out = self.fields(module, "ServerArgs")
        for ns in namespaces:
            where, _ = self.class_def(module, ns)
            out |= self.fields(where, ns)
        return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return names, a.kwarg is not None


_SKIP_REASON: list[str] = []  # one download attempt per session, even when it fails


@cache
def _wheel() -> WheelSource:
    if _SKIP_REASON:
        pytest.skip(_SKIP_REASON[0])
    try:
        return WheelSource(_download_wheel())
    except pytest.skip.Exception as e:
        _SKIP_REASON.append(str(e))
        raise


@pytest.fixture(scope="module")
def wheel() -> WheelSource:
    t0 = time.perf_counter()
    src = _wheel()
    print(f"wheel ready in {time.perf_counter() - t0:.1f} s")
    return src


# ----------------------------------------------------------------------------------------------
# against the wheel


@pytest.mark.network
def test_wheel_is_the_pinned_version(wheel):
    metadata = wheel.zip.read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode("utf-8")
    assert f"\nVersion: {SGLANG_VERSION}\n" in metadata


@pytest.mark.network
@pytest.mark.parametrize("use", [u for u in SGLANG_API if u.kind == "class"], ids=lambda u: u.name)
def test_class_importable_with_fields(wheel, use: ApiUse):
    wheel.class_def(use.module, use.name)  # the import path the backend uses
    missing = set(use.keywords) - wheel.fields(use.module, use.name)
    assert not missing, f"{use.module}.{use.name} has no field(s) {sorted(missing)}"


@pytest.mark.network
@pytest.mark.parametrize(
    "use", [u for u in SGLANG_API if u.kind == "function"], ids=lambda u: u.name
)
def test_function_importable_with_keywords(wheel, use: ApiUse):
    _, fn = wheel.resolve(use.module, use.name)
    assert isinstance(fn, ast.FunctionDef), f"{use.module}.{use.name} is not a function"
    names, var_kw = _params(fn)
    missing = set(use.keywords) - names
    assert var_kw or not missing, f"{use.name} takes no keyword(s) {sorted(missing)}"


@pytest.mark.network
def test_engine_kwargs_are_server_args_fields(wheel):
    (use,) = [u for u in SGLANG_API if u.kind == "server_args"]
    fields = wheel.server_args_fields()
    assert len(fields) > 100  # sanity: the namespaces were really collected
    missing = set(use.keywords) - fields
    assert not missing, f"ServerArgs has no field(s) {sorted(missing)}"
    # Engine(**kwargs) really builds ServerArgs(**kwargs)
    _, engine = wheel.class_def("sglang.srt.entrypoints.engine", "Engine")
    init = wheel.method("sglang.srt.entrypoints.engine", "Engine.__init__")
    assert _params(init)[1], "Engine.__init__ no longer takes **kwargs"
    assigned = {
        (t.id, node.value.id)
        for node in engine.body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Name)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    assert ("server_args_class", "ServerArgs") in assigned


@pytest.mark.network
@pytest.mark.parametrize("use", [u for u in SGLANG_API if u.kind == "method"], ids=lambda u: u.name)
def test_method_exists_with_keywords(wheel, use: ApiUse):
    fn = wheel.method(use.module, use.name)
    is_async = isinstance(fn, ast.AsyncFunctionDef)
    assert is_async == use.is_async, (
        f"{use.name} is {'async' if is_async else 'sync'} in the wheel, the backend "
        f"{'awaits' if use.is_async else 'calls'} it"
    )
    names, var_kw = _params(fn)
    missing = set(use.keywords) - names
    assert var_kw or not missing, f"{use.name} takes no keyword(s) {sorted(missing)}"


@pytest.mark.network
@pytest.mark.parametrize(
    "use", [u for u in SGLANG_API if u.kind == "attribute"], ids=lambda u: u.name
)
def test_attribute_exists(wheel, use: ApiUse):
    cls, attr = use.name.split(".")
    assert attr in wheel.instance_attributes(use.module, cls)


@pytest.mark.network
@pytest.mark.parametrize(
    "use", [u for u in SGLANG_API if u.kind == "literal"], ids=lambda u: u.name
)
def test_literals_exist(wheel, use: ApiUse):
    missing = set(use.keywords) - wheel.words(use.module)
    assert not missing, f"{use.module} no longer mentions {sorted(missing)} ({use.name})"


@pytest.mark.network
def test_wheel_requires_the_python_the_docs_state(wheel):
    """sglang 0.5.23 needs Python >= 3.11: the install docs and the extra's comment say so."""
    metadata = wheel.zip.read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode("utf-8")
    assert "\nRequires-Python: >=3.11\n" in metadata
    root = BACKEND_SOURCE.parents[2]
    assert "Python ≥ 3.11" in (root / "docs" / "sglang_backend.md").read_text()
    pyproject = (root / "pyproject.toml").read_text()
    (line,) = [x for x in pyproject.splitlines() if x.startswith("sglang = ")]
    assert "python >= 3.11" in line.lower()


@pytest.mark.network
@pytest.mark.parametrize(
    "module, needle, why",
    [
        (
            "sglang.srt.managers.scheduler",
            "parent_process.send_signal(signal.SIGQUIT)",
            "a scheduler exception SIGQUITs the training rank",
        ),
        (
            "sglang.srt.entrypoints.engine",
            "signal.signal(signal.SIGQUIT, cfg.custom_sigquit_handler)",
            "Engine() installs our SIGQUIT handler instead of its kill_process_tree",
        ),
        (
            "sglang.srt.managers.tokenizer_manager",
            "if threading.current_thread() is threading.main_thread():\n"
            "            signal_handler = self.signal_handler_class(self)",
            "the tokenizer manager replaces it only when its loop starts on the main thread "
            "(ours runs in a thread of its own)",
        ),
        (
            "sglang.srt.sampling.sampling_batch_info",
            "if enable_deterministic",
            "sampling_seed is only used with enable_deterministic_inference",
        ),
        (
            "sglang.srt.sampling.sampling_batch_info",
            "else 42",
            "a request without sampling_seed gets 42 in deterministic mode",
        ),
        (
            "sglang.srt.arg_groups.overrides",
            'return {"sampling_backend": "pytorch"}',
            "deterministic inference forces the pytorch sampler",
        ),
        (
            "sglang.srt.utils.patch_torch",
            "_device_to_uuid",
            "the producer-side patch sends the GPU's UUID",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) and x.startswith("sglang") else "",
)
def test_behaviour_the_backend_relies_on(wheel, module, needle, why):
    text = wheel.zip.read(wheel.path_of(module)).decode()
    assert needle in text, f"{module} changed: {why} may no longer hold"


@pytest.mark.network
def test_update_weights_needs_a_session_and_version_is_per_token(wheel):
    """The two 0.5.23 facts the publish sequence is built on, read from the scheduler source."""
    text = wheel.zip.read(
        wheel.path_of("sglang.srt.managers.scheduler_components.weight_updater")
    ).decode()
    assert "update_weights_from_tensor must run between" in text  # begin/end session required
    assert "record_weight_version_after_update" in text
    sched = wheel.zip.read(wheel.path_of("sglang.srt.managers.scheduler")).decode()
    assert "def handle_update_weight_version" in sched
    assert "record_weight_version_events(live_reqs" in sched  # every live request gets an event


# ----------------------------------------------------------------------------------------------
# against the backend's own source (offline)

_RECEIVERS = {"_engine": "Engine", "_tm": "TokenizerManager"}
_OUTPUT_NAMES = {"out", "meta", "span", "finish"}


def _self_attr(node: ast.AST) -> str | None:
    """'x' for ``self.x``."""
    is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    return node.attr if is_self and node.value.id == "self" else None


def _is_api_name(node: ast.AST) -> bool:
    """``api`` (the namespace ``_load_sglang_api`` returns, passed to module functions)."""
    return isinstance(node, ast.Name) and node.id == "api"


def _backend_uses() -> dict[str, list]:
    tree = ast.parse(BACKEND_SOURCE.read_text())
    awaited = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Await)}
    # a coroutine handed to ``self._tm_await(what, coro)`` is awaited there (with a timeout)
    awaited |= {
        id(n.args[1])
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _self_attr(n.func) == "_tm_await" and len(n.args) == 2
    }
    calls: list[
        tuple[str, list[str | None], int, bool]
    ] = []  # (qualname, keywords, n_pos, awaited)
    called_funcs = set()
    attributes: list[str] = []
    imports: set[tuple[str, str]] = set()
    output_keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            imports |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            owner = _self_attr(f.value)
            qual = None
            if owner in _RECEIVERS:
                qual = f"{_RECEIVERS[owner]}.{f.attr}"
            elif owner == "_api" or _is_api_name(f.value):
                qual = f.attr
            elif isinstance(f.value, ast.Attribute) and (
                _self_attr(f.value.value) == "_api" or _is_api_name(f.value.value)
            ):
                qual = f"{f.value.attr}.{f.attr}"
            if qual is not None:
                called_funcs.add(id(f))
                calls.append(
                    (qual, [k.arg for k in node.keywords], len(node.args), id(node) in awaited)
                )
            is_get = isinstance(f.value, ast.Name) and f.value.id in _OUTPUT_NAMES
            if is_get and f.attr == "get" and isinstance(node.args[0], ast.Constant):
                output_keys.add(node.args[0].value)
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id in _OUTPUT_NAMES
            and isinstance(node.slice, ast.Constant)
        ):
            output_keys.add(node.slice.value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in called_funcs:
            owner = _self_attr(node.value)
            if owner in _RECEIVERS:
                attributes.append(f"{_RECEIVERS[owner]}.{node.attr}")
    return {"calls": calls, "attributes": attributes, "imports": imports, "keys": output_keys}


def test_table_matches_backend_source():
    uses = _backend_uses()
    table = {
        u.name: u for u in SGLANG_API if u.kind in ("class", "function", "method", "attribute")
    }
    # imports: exactly the table's classes and functions, from the same modules
    imported = {(u.module, u.name) for u in SGLANG_API if u.kind in ("class", "function")}
    assert uses["imports"] == imported
    used_methods, used_classes, used_functions = set(), set(), set()
    for qual, keywords, n_pos, is_awaited in uses["calls"]:
        assert qual in table, f"the backend calls SGLang's {qual}, which is not in SGLANG_API"
        use = table[qual]
        if use.kind == "class":
            used_classes.add(qual)
            if qual == "Engine":
                assert keywords == [None] and n_pos == 0  # Engine(**kwargs): see server_args
                continue
        elif use.kind == "function":
            used_functions.add(qual)
        else:
            assert use.kind == "method", f"{qual} is called but listed as {use.kind}"
            used_methods.add(qual)
            assert is_awaited == use.is_async, f"{qual}: awaited={is_awaited}, table={use.is_async}"
        assert n_pos == 0, f"{qual}: pass arguments to SGLang by keyword"
        unknown = set(keywords) - set(use.keywords)
        assert not unknown, f"{qual} is called with {sorted(unknown)}, not in SGLANG_API"
    assert used_methods == {u.name for u in SGLANG_API if u.kind == "method"}, "unused entries"
    assert used_functions == {u.name for u in SGLANG_API if u.kind == "function"}
    assert used_classes == {u.name for u in SGLANG_API if u.kind == "class"} - {
        "MultiprocessingSerializer"  # only its method is called
    }
    # attributes read on the engine are listed (a listed method may also be referenced, e.g.
    # handed to atexit.unregister)
    for attr in uses["attributes"]:
        assert attr in table and table[attr].kind in ("attribute", "method"), (
            f"{attr} not in SGLANG_API"
        )
    read = {a for a in uses["attributes"] if table[a].kind == "attribute"}
    assert read == {u.name for u in SGLANG_API if u.kind == "attribute"}
    # every key read from an SGLang output is a listed literal
    literals = set().union(*(u.keywords for u in SGLANG_API if u.kind == "literal"))
    assert uses["keys"] and uses["keys"] <= literals, uses["keys"] - literals


def test_server_args_and_sampling_keys_are_in_the_table():
    args = backend.engine_server_args(
        model_path="m", local_rank=3, port=30024, nccl_port=30025, mem_fraction_static=0.4,
        dtype="bfloat16", load_format="dummy", memory_mode="sleep", weights_cpu_backup=False,
        random_seed=1, version=7, context_length=None, sampling_backend=None,
        enable_deterministic_inference=False, rl_on_policy_target=None, log_level="error",
    )  # fmt: skip
    assert tuple(args) == SERVER_ARG_KEYS
    assert args["tp_size"] == 1 and args["base_gpu_id"] == 3 and args["skip_tokenizer_init"]
    assert args["weight_version"] == "7" and args["enable_memory_saver"] is True
    (names,) = [u.keywords for u in SGLANG_API if u.name == "sampling parameter names"]
    seen: set[str] = set()
    for p in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=(2,), seed=3),
        SamplingParams(temperature=0.0, seed=3),
    ):
        seen |= set(backend.sglang_sampling_params(p, send_seed=True))
    assert seen == set(names)


@pytest.mark.network
def test_smoke_check_extra_server_args_exist(wheel):
    """The GPU smoke check passes extra ServerArgs through unchecked: check their names here."""
    from tests.gpu.sglang_smoke import SMOKE_EXTRA_SERVER_ARGS

    missing = set(SMOKE_EXTRA_SERVER_ARGS) - wheel.server_args_fields()
    assert not missing, f"ServerArgs has no field(s) {sorted(missing)}"


@pytest.mark.network
@pytest.mark.parametrize(
    "method, keywords",
    [
        ("generate", ("input_ids", "sampling_params", "return_logprob", "rid")),
        ("update_weights_from_tensor", ("named_tensors", "load_format", "flush_cache")),
        ("release_memory_occupation", ("tags",)),
        ("resume_memory_occupation", ("tags",)),
        ("flush_cache", ()),
        ("begin_weight_update", ()),
        ("end_weight_update", ()),
    ],
)
def test_engine_sync_methods_are_the_async_calls_we_make(wheel, method, keywords):
    """The backend uses the tokenizer manager's coroutines instead of Engine's sync methods (which
    run ``loop.run_until_complete`` and cannot run while the loop runs in our thread). Check that
    each sync method exists with the documented keywords and is exactly that coroutine run on the
    engine loop, so the two paths do the same thing."""
    fn = wheel.method("sglang.srt.entrypoints.engine", f"Engine.{method}")
    names, _ = _params(fn)
    assert set(keywords) <= names, f"Engine.{method} lacks {sorted(set(keywords) - names)}"
    target = "generate_request" if method == "generate" else method
    called = {
        n.func.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute)
        and n.func.value.attr == "tokenizer_manager"
    }
    assert target in called, f"Engine.{method} no longer calls tokenizer_manager.{target}"
    source = ast.unparse(fn)
    assert "run_until_complete" in source

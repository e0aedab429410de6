"""What the Triton kernel tests share: the fixes to Triton 3.6's CPU interpreter, kernel cases run
in a child process, and the sm_90 target with its ptxas resource report (no GPU needed).

``TRITON_INTERPRET`` must be set before Triton decides how to wrap a ``@triton.jit`` function, so
interpreted kernels run in a process started with it (``child_results`` / ``child_main``). Triton
is imported only inside the functions that need it, so a test module that keeps Triton out of the
pytest process (``test_moe_kernel``) can import this one.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOPPER_SMEM_PER_BLOCK = 227 * 1024  # H100/H200 opt-in maximum per CTA


# ------------------------------------------------------------------------ interpreter fixes

@contextmanager
def interpreter_fixes():
    """Work around two defects of Triton 3.6's interpreter, for this process and this block only
    (the GPU path does not go through them):

    1. a runtime scalar is a one-element array and the interpreter turns it into a Python int with
       ``int(array)``, which NumPy >= 2.4 rejects, so every loop bound taken from a kernel argument
       (``range(0, HIDDEN, BLOCK_K)``) fails (triton-lang/triton#9171, fixed upstream by #9172
       after 3.6);
    2. the interpreter stores bf16 as its uint16 bit pattern and ``tl.dot`` multiplies the bits
       (triton-lang/triton#11584). bf16 operands are widened to fp32 first: exact, as on the
       tensor cores, whose bf16 products accumulate in fp32.

    And one of its costs: every call of a ``@triton.jit`` helper from a kernel patches the
    language modules its globals see again (``inspect.getmembers`` of each, a third of an
    interpreted case's time), though the launch running it patched them already with the same
    builder. A helper's call inside a launch whose patches (or an earlier helper's, which are never
    undone) cover its modules skips that; any other call patches as before. Three more, together
    half of an interpreted case's time: every add, subtract and multiply of 8- to 32-bit integers
    computes its overflow check in 64 bits for a ``device_assert`` that is a no-op without
    ``debug``, which the interpreter's options never set (here computed only with it);
    ``_get_np_dtype`` builds its table of every dtype on each call (here each answer is kept); and
    each ``tl.tuple`` (a tensor's or a block type's shape, made with every one) builds its type,
    element by element, which the interpreter seldom reads (here built when read:
    ``tl.tuple.type``, as the tuple's values are then, which only ``_setitem`` changes, setting
    the type again)."""
    import numpy as np
    import triton.language as tl
    from triton.language import core, semantic
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    def dot(self, a, b, d, *args):
        return create_dot(self, widen(a), widen(b), d, *args)

    launch, helper_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    patched = []  # per running launch, the language modules its patches cover

    def languages(fn) -> set:  # as interpreter._patch_lang finds them
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def launched(self, *args, **kwargs):
        patched.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper(self, *args, **kwargs):
        if patched and languages(self.fn) <= patched[-1]:
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        if patched:  # a helper's patches are never undone: they stand for the rest of the launch
            patched[-1] |= languages(self.fn)
        return helper_call(self, *args, **kwargs)

    sanitize = semantic.TritonSemantic.binary_op_sanitize_overflow_impl

    def sanitize_if_asserted(self, lhs, rhs, binary_op):
        if self.builder.options.debug:  # device_assert asserts nothing without it
            sanitize(self, lhs, rhs, binary_op)

    np_dtype, np_dtypes = interpreter._get_np_dtype, {}

    def cached_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # as _get_np_dtype: a block's by its elements'
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return np_dtype(tt_dtype)
        if tt_dtype not in np_dtypes:
            np_dtypes[tt_dtype] = np_dtype(tt_dtype)
        return np_dtypes[tt_dtype]

    def tuple_init(self, args, type=None):  # core.tuple.__init__, the type left to tuple_type
        self.values = [i for i in args]
        if isinstance(type, core.tuple_type):
            self.type = type
        elif type is not None:  # make_template in ASTFunction.deserialize may pass a list
            self.type = core.tuple_type(type)

    def tuple_type(self):
        if "_type" not in self.__dict__:
            self.__dict__["_type"] = core._type_for_tuple_values(self.values)
        return self.__dict__["_type"]

    def set_tuple_type(self, value):
        self.__dict__["_type"] = value

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(semantic.TritonSemantic, "binary_op_sanitize_overflow_impl",
                   sanitize_if_asserted)
        mp.setattr(interpreter, "_get_np_dtype", cached_np_dtype)
        mp.setattr(core.tuple, "__init__", tuple_init)
        mp.setattr(core.tuple, "type", property(tuple_type, set_tuple_type), raising=False)
        mp.setattr(interpreter, "_patch_lang_tensor", patched_tensor)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
        mp.setattr(interpreter.GridExecutor, "__call__", launched)
        mp.setattr(interpreter.InterpretedFunction, "__call__", helper)
        yield


# ------------------------------------------------------------------ kernel cases in a child

def run_cases(cases: dict) -> dict:
    """``{name: (fn, *args)}`` run one by one; ``{name: {"ok", "detail"}}``, the detail being the
    case's return value or its traceback."""
    results = {}
    for name, (fn, *args) in cases.items():
        try:
            results[name] = {"ok": True, "detail": fn(*args)}
        except Exception:
            results[name] = {"ok": False, "detail": traceback.format_exc()}
    return results


def child_main(argv: list[str], interpreter_cases: dict, compile_cases: dict,
               patch=None) -> int:
    """Entry of a test module's child processes: ``--interpreter`` runs ``interpreter_cases``
    under ``interpreter_fixes`` (and ``patch()``, a further fix of the module's own),
    ``--compile-sm90`` runs ``compile_cases``; prints ``run_cases``' JSON object."""
    if argv == ["--interpreter"]:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        with interpreter_fixes():
            if patch:
                patch()
            results = run_cases(interpreter_cases)
    elif argv == ["--compile-sm90"]:
        results = run_cases(compile_cases)
    else:
        raise SystemExit(f"unknown arguments {argv}")
    print(json.dumps(results))
    return 0


# The test modules whose children run together: per flag, one child runs the cases of every
# module that this session runs tests of and that runs its cases through ``child_main``
# (``batched``, set by tests/conftest.py, which keeps their tests on one xdist worker), each as
# ``python -m module flag`` would, in ``batch_order``. A child starts in 3 to 4 s (Python, torch,
# Triton, the module), ten of them once a run. Modules of ``BATCH_LAST`` run after the others:
# test_trace's interpreter patch (``_patch_inline_asm``) stays for the rest of its process.
BATCH_LAST = ("tests.experiments.moe.test_trace",)
batched: list[str] = []


def is_batched(module) -> bool:
    """Whether test ``module`` (a module object) runs its cases in children of ``child_main``."""
    return getattr(module, "child_main", None) is child_main


def batch_order(modules) -> list[str]:
    return sorted(set(modules), key=lambda m: (m in BATCH_LAST, m))
_batch_results: dict[str, dict] = {}  # flag -> {module: its child_main JSON, or its failure}


def _child(argv: list[str], interpret: bool, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def child_results(module: str, flag: str, interpret: bool, timeout: int) -> dict:
    """Run ``python -m module flag`` from the repository root, with ``TRITON_INTERPRET=1`` from
    its start or without it; the JSON object its last output line holds (``child_main``'s). A
    module of ``batched`` is run with the others in one child (``batch_main``), once per flag."""
    if module in batched:
        if flag not in _batch_results:
            proc = _child([__name__, "--batch", flag, *batched], interpret,
                          timeout * len(batched))
            if proc.returncode:
                raise AssertionError(f"child {flag} of {batched} failed:\n{proc.stdout}\n"
                                     f"{proc.stderr}")
            _batch_results[flag] = json.loads(proc.stdout.strip().splitlines()[-1])
        result = _batch_results[flag][module]
        if "failed" in result:
            raise AssertionError(f"child {flag} of {module} failed:\n{result['failed']}")
        return result["results"]
    proc = _child([module, flag], interpret, timeout)
    if proc.returncode:
        raise AssertionError(f"child {flag} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def batch_main(flag: str, modules: list[str]) -> int:
    """Entry of a batched child: each module run as ``python -m module flag`` (its ``__main__``,
    ``child_main``) in turn; prints {module: {"results": its JSON} or {"failed": why}}."""
    import runpy

    out = {}
    for module in modules:
        sys.argv = [module, flag]
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):
                try:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                except SystemExit as e:
                    if e.code not in (0, None):
                        raise
            out[module] = {"results": json.loads(printed.getvalue().strip().splitlines()[-1])}
        except BaseException:  # noqa: BLE001 (reported to the parent's tests of this module)
            out[module] = {"failed": printed.getvalue()[-4000:] + traceback.format_exc()}
    print(json.dumps(out))
    return 0


def assert_case_ok(results: dict, case: str) -> None:
    result = results[case]
    assert result["ok"], result["detail"]


def interpreter_case_tests(module: str, cases: dict, timeout: int = 1800):
    """The module-scoped fixture that runs ``cases`` in one ``--interpreter`` child of ``module``
    (``child_main``) and the test that reports each case on its own; bind both in the test module:
    ``interpreter_results, test_interpreter_case = interpreter_case_tests(...)``."""
    @pytest.fixture(scope="module")
    def interpreter_results():
        return child_results(module, "--interpreter", interpret=True, timeout=timeout)

    @pytest.mark.parametrize("case", list(cases))
    def test_interpreter_case(interpreter_results, case):
        assert_case_ok(interpreter_results, case)

    return interpreter_results, test_interpreter_case


# ------------------------------------------------------------------------- sm_90 compilation

def hopper_target():
    """The H100/H200 (sm_90) compile target."""
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", 90, 64)


# ptxas -v's log of each kernel ``compile_sm90`` built in this process, by its PTX: Triton runs
# ptxas -v itself to make the cubin, so ``ptxas_report`` reads that log instead of running ptxas
# on the same PTX again (a quarter of an sm_90 compile's time).
_PTXAS_LOGS: dict[str, str] = {}


def _ptxas_log_file(ptx: str) -> Path:
    """Where ptxas -v's log of ``ptx`` is kept beside Triton's cache, which holds the kernel
    itself (so a later run's compile does not run ptxas and leaves no log): named by the PTX and
    the ptxas binary (its path, size and time), so another PTX or ptxas is another file."""
    import hashlib

    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    binary = Path(get_ptxas(90).path)
    stat = binary.stat()
    key = hashlib.sha256(f"{binary}|{stat.st_size}|{stat.st_mtime_ns}|-arch=sm_90a|{ptx}".encode())
    return Path(triton.knobs.cache.dir) / "ptxas_v_logs" / f"{key.hexdigest()}.log"


def _keep_ptxas_log(ptx: str, log: str) -> None:
    _PTXAS_LOGS[ptx] = log
    try:
        path = _ptxas_log_file(ptx)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(log)
        os.replace(tmp, path)  # whole, where two workers write the same log
    except OSError:
        pass  # a read-only cache: ptxas runs again next time


def compile_sm90(src, **options):
    """``src`` (an ``ASTSource`` or ``GluonASTSource``) compiled by Triton for sm_90
    (``hopper_target``) with ``options``, keeping the log of Triton's own ``ptxas -v`` (none where
    Triton's cache held the kernel) for ``ptxas_report``."""
    import triton

    log = io.StringIO()
    with triton.knobs.nvidia.scope(), redirect_stdout(log):
        triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas's log
        kernel = triton.compile(src, target=hopper_target(), options=options)
    if "Used " in log.getvalue():
        _keep_ptxas_log(kernel.asm["ptx"], log.getvalue())
    return kernel


def sass_bytes(cubin: bytes, kernel: str) -> int:
    """The size of ``kernel``'s machine code in a cubin: its ELF section ``.text.<kernel>``."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    names = headers[shstrndx][4]  # sh_offset of the section-name table
    for name, *_, size, _, _, _, _ in headers:
        if cubin[names + name:cubin.index(b"\0", names + name)] == f".text.{kernel}".encode():
            return size
    raise KeyError(f"no .text.{kernel} in the cubin")


def ptxas_report(ptx: str) -> dict:
    """Registers per thread (the most of any kernel in the module), spilled bytes and whether
    wgmma was serialized, for a PTX module, from Triton's bundled ``ptxas -v`` for sm_90a: the
    run that built it in ``compile_sm90``, else the log kept from an earlier run of the same ptxas
    on the same PTX (``_ptxas_log_file``), else one of its own."""
    from triton.backends.nvidia.compiler import get_ptxas

    log = _PTXAS_LOGS.get(ptx)
    if log is None:
        try:
            log = _ptxas_log_file(ptx).read_text()
        except OSError:
            pass
    if log is None or "Used " not in log:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o",
                                  str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                                 check=True)
        log = out.stdout + out.stderr
        _keep_ptxas_log(ptx, log)
    return {"registers": max(int(v) for v in re.findall(r"Used (\d+) registers", log)),
            "spill_store_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)),
            "spill_load_bytes": sum(int(v) for v in re.findall(r"(\d+) bytes spill loads", log)),
            # ptxas's advisory when it waits for each wgmma before issuing the next
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}


if __name__ == "__main__":  # a batched child: --batch FLAG MODULE...
    if sys.argv[1:2] != ["--batch"] or len(sys.argv) < 4:
        raise SystemExit(f"unknown arguments {sys.argv[1:]}")
    raise SystemExit(batch_main(sys.argv[2], sys.argv[3:]))

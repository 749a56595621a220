"""Diagnostics for the cold-start calls: at exit, dynamo's compile-time table and when inductor's compile pool
was warmed / first used / first ready, and how many kernels asked for it before it was ready."""
import atexit, importlib.abc, importlib.util, os, sys, time

_T0 = time.time()
_POOL = {"warm_at": None, "first_ask_at": None, "ready_at": None, "asked_not_ready": 0, "asked_ready": 0}


def _patch(module):
    AC = module.AsyncCompile
    use = AC.use_process_pool.__func__
    warm = AC.warm_pool.__func__

    def use_process_pool(cls):
        r = use(cls)
        t = round(time.time() - _T0, 2)
        if _POOL["first_ask_at"] is None:
            _POOL["first_ask_at"] = t
        if r and _POOL["ready_at"] is None:
            _POOL["ready_at"] = t
        _POOL["asked_ready" if r else "asked_not_ready"] += 1
        return r

    def warm_pool(cls):
        if _POOL["warm_at"] is None:
            _POOL["warm_at"] = round(time.time() - _T0, 2)
        return warm(cls)

    AC.use_process_pool = classmethod(use_process_pool)
    AC.warm_pool = classmethod(warm_pool)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch._inductor.async_compile":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                _patch(module)
            except Exception as e:  # diagnostics only
                sys.stderr.write(f"[sc] patch failed: {e!r}\n")

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())


def _report():
    u = sys.modules.get("torch._dynamo.utils")
    if u is None or "torch._inductor.async_compile" not in sys.modules:
        return
    try:
        table = u.compile_times(repr="str", aggregate=True)
    except Exception as e:
        table = f"compile_times failed: {e!r}"
    if "compile_inner" not in str(table):  # not a process that compiled (a compile worker, the launcher)
        return
    sys.stderr.write(f"[sc pid {os.getpid()}] pool {_POOL} (seconds from interpreter start)\n[sc table]\n{table}\n")
    sys.stderr.flush()


atexit.register(_report)

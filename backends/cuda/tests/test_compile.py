"""Every kernel the backend can launch compiles with NVRTC for Hopper, and for Ada a program of each kind (no GPU
or driver needed). The kernels have no code that depends on the target (a test below checks that), so the Ada
build differs from Hopper's only in code generation: one program of each source file shows that the target is
accepted, at a fraction of the time of all of them."""

from importlib import resources

import pytest
from leat_backend_cuda import build, compiler


def ada_jobs() -> list[tuple[str, list[str], str]]:
    return list({file: (file, names, "sm_89") for file, names, _ in build.jobs("sm_89")}.values())


@pytest.mark.parametrize("arch", ["sm_90", "sm_89"])
def test_every_kernel_compiles(arch, monkeypatch):
    """Every program compiles without a warning (on sm_90 wgmma.cu's too, for sm_90a; not on Ada). Through the
    kernel cache the other tests use (content-addressed: source, headers, options, names and NVRTC version), so a
    program another test or an earlier run compiled from these very sources is not compiled twice; its cached build
    log is checked as a fresh one would be."""
    jobs = build.jobs(arch) if arch == "sm_90" else ada_jobs()
    assert ("wgmma.cu" in {file for file, _, _ in jobs}) == (arch == "sm_90")
    monkeypatch.setattr(build, "jobs", lambda _: jobs)
    results = build.build_all(arch, use_cache=True)
    assert len(results) == len(jobs)
    for (file, names, target), (first, _, size, _) in zip(jobs, results):
        assert first == names[0] and size > 0
        built = compiler.compile_program(file, names, target)  # from the cache the build wrote or found
        assert built.cached and set(built.names) == set(names)
        assert built.cubin[:4] == b"\x7fELF"
        assert all(built.params[name] for name in names)
        assert "warning" not in built.log.lower(), built.log


def test_cache_returns_the_same_cubin(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAT_HOME", str(tmp_path))
    first = compiler.compile_program("ops.cu", ["rms_norm", "add"], "sm_90")
    second = compiler.compile_program("ops.cu", ["rms_norm", "add"], "sm_90")
    assert not first.cached and second.cached
    assert first.cubin == second.cubin and first.names == second.names and first.params == second.params
    assert list((tmp_path / "cuda").glob("ops-sm_90-*.cubin"))
    # NVRTC wrote its (empty) log into a buffer of ours: never into the interpreter's shared one-byte b" "
    assert list(b" " * 4) == [32, 32, 32, 32]


def test_a_syntax_error_is_reported_with_the_log(monkeypatch):
    real = compiler.source
    monkeypatch.setattr(compiler, "source", lambda name: real(name) + ("\nint broken(" if name == "ops.cu" else ""))
    with pytest.raises(compiler.CompileError, match="ops.cu"):
        compiler.compile_program("ops.cu", ["add"], "sm_90", use_cache=False)


def test_no_kernel_source_depends_on_the_target():
    """What lets the Ada build above compile one program per source file: no __CUDA_ARCH__ branches."""
    kernels = resources.files("leat_backend_cuda") / "kernels"
    sources = [f for f in kernels.iterdir() if f.name.endswith((".cu", ".cuh"))]
    assert len(sources) >= 8
    assert not [f.name for f in sources if "__CUDA_ARCH__" in f.read_text()]

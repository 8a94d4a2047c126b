import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slimgrad import cli
from slimgrad.cli import main

pytest.importorskip("transformers")

# The tiny Llama the --hf-config tests build (fields of LlamaConfig).
_TINY_LLAMA = [
    "num_hidden_layers=1",
    "hidden_size=32",
    "intermediate_size=64",
    "num_attention_heads=4",
    "num_key_value_heads=2",
    "vocab_size=128",
]


def _sets(fields):
    return [a for f in fields for a in ("--set", f)]


def _one_line_error(capsys, argv, match=None, after_progress=False):
    # exit status 2 and one line on stderr in the slimgrad form, nothing on stdout (a user's model
    # failing during the run: after the progress lines of that run)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    lines = err.strip().splitlines()
    if after_progress:
        assert all(" the eager step" in ln or " the slimgrad step" in ln for ln in lines[:-1])
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("slimgrad "), err
    assert "Traceback" not in err and out == ""
    if match is not None:
        assert match in lines[0], lines[0]
    return lines[0]


def test_profile_json_and_verify(capsys):
    argv = ["profile", "gpt2", "--size", "tiny", "--seq", "16", "--batch", "2", "--json"]
    assert main([*argv, "--verify"]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    rec = json.loads(lines[0])  # the record, then verify's report
    assert rec["target"] == "hf:gpt2" and rec["batch"] == 2 and not rec["estimated"]
    assert 0 < rec["slimgrad"]["saved_bytes"] < rec["eager"]["saved_bytes"]
    # progress on stderr, one line per side
    assert "measuring the eager step, batch 2" in err and "measuring the slimgrad step" in err
    assert "verify: OK" in "\n".join(lines[1:])


def test_estimate_matches_profile_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert main(["estimate", "bert", "--size", "tiny", "--seq", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    est = json.loads(out.strip().splitlines()[-1])
    assert "estimating the eager step" in err
    assert (
        main(["profile", "bert", "--size", "tiny", "--seq", "16", "--json", "--plot", str(png)])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    real = json.loads(lines[-2])
    assert est["estimated"] and est["eager"]["peak_bytes"] == real["eager"]["peak_bytes"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fit_reports_eager_batch_beside_slimgrads(capsys):
    # seq 64: bytes affine in the batch from batch 1, five probes (seq 16 takes eleven)
    argv = ["profile", "gpt2", "--size", "tiny", "--seq", "64", "--fit-gib", "0.005"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    head = out.splitlines()[0]
    assert head.startswith("hf:gpt2: largest batch fitting in 0.005 GiB: slimgrad ")
    s, e = (
        int(head.split(f"{side} ")[1].split(",")[0].split(" ")[0]) for side in ("slimgrad", "eager")
    )
    assert s >= e >= 1 and f"slimgrad {s}, eager {e} ({s / e:.2f}x eager's)" in head
    assert f"hf:gpt2, batch {s}, cpu kernels (estimated under fake tensors)" in out
    # progress: each batch tried, with its bytes, on stderr; both answers proved by a probe
    assert "searching the largest batch of hf:gpt2 within 0.005 GiB" in err
    assert f"batch {s}: slimgrad " in err and f"batch {e + 1}: " in err and "(over)" in err


def test_fit_json_each_side_is_the_largest_that_fits(factory_dir, capsys):
    assert main(["estimate", f"{factory_dir}:build", "--fit-gib", "0.0005", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    s, e = rec["slimgrad_batch"], rec["eager_batch"]
    assert s >= 1 and e >= 1 and rec["budget_bytes"] == int(0.0005 * 2**30)
    # each side's batch fits and the next one does not, from the probes' own figures
    for side, b in (("slimgrad", s), ("eager", e)):
        assert rec["probes"][str(b)][side] <= rec["budget_bytes"] < rec["probes"][str(b + 1)][side]
    assert rec["report"]["batch"] == s and rec["report"]["estimated"]


def test_profile_dtype_bfloat16_is_a_bf16_weights_step(capsys):
    argv = ["profile", "llama", "--size", "tiny", "--seq", "16", "--batch", "2", "--json"]
    recs = {}
    for dtype in ("float32", "bfloat16"):
        assert main([*argv, "--dtype", dtype]) == 0
        recs[dtype] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    f32, bf16 = recs["float32"], recs["bfloat16"]
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # every parameter the step keeps is kept at 2 bytes instead of 4, on both sides
    for side in ("eager", "slimgrad"):
        assert 2 * bf16[side]["saved_param_bytes"] == f32[side]["saved_param_bytes"] > 0
    assert bf16["slimgrad"]["saved_bytes"] < bf16["eager"]["saved_bytes"]


def test_unknown_target(capsys):
    _one_line_error(capsys, ["profile", "nope"], "unknown target 'nope'")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["profile", "resnet", "--fit-gib", "-1"], "--fit-gib must be a positive number"),
        (["profile", "resnet", "--fit-gib", "0"], "--fit-gib must be a positive number"),
        (["profile", "resnet", "--fit-gib", "nan"], "got nan"),
        (["profile", "resnet", "--fit-gib", "inf"], "got inf"),
        (["profile", "resnet", "--fit-gib", "8", "--batch", "2"], "without --batch"),
        (["profile", "resnet", "--fit-gib", "8", "--verify"], "without --verify"),
        (["profile", "resnet", "--batch", "0"], "--batch must be positive"),
        (["profile", "resnet", "--batch", "-2"], "got -2"),
        (["profile", "resnet", "--batch", "two"], "invalid int value: 'two'"),
        (["profile", "gpt2", "--seq", "0"], "--seq must be positive"),
        (["profile", "gpt2", "--depth", "0"], "--depth must be positive"),
        (["profile", "gpt2", "--dtype", "float16"], "invalid choice: 'float16'"),
        (["profile", "gpt2", "--bogus"], "unrecognized arguments: --bogus"),
        (["profile"], "expected TARGET or --hf-config CONFIG, got neither"),
        (["profile", "gpt2", "--hf-config", "llama"], "got both"),
        (["estimate", "gpt2", "--verify"], "--verify needs a measured, converted run"),
        (["profile", "gpt2", "--estimate", "--verify"], "got --estimate"),
        (["profile", "gpt2", "--no-convert", "--verify"], "got --no-convert"),
        (["profile", "resnet", "--no-convert", "--inplace-abn"], "--inplace-abn"),
        (["profile", "gpt2", "--set", "n_layer=abc"], "expected an integer, got 'abc'"),
        (["profile", "gpt2", "--set", "n_layer=1.5"], "GPT2Config.n_layer"),
        (["profile", "gpt2", "--set", "use_cache=maybe"], "expected true or false"),
        (["profile", "gpt2", "--set", "typo=3"], "unknown field 'typo' of GPT2Config"),
        (["profile", "gpt2", "--set", "n_layr=3"], "Did you mean 'n_layer'?"),
        (["profile", "gpt2", "--set", "n_layer"], "--set takes KEY=VALUE"),
        (["profile", "gpt2", "--set", "n_embd=30", "--set", "n_head=4"], "does not build a model"),
        (["profile", "conv_chain", "--set", "a=1"], "--set overrides HF config fields"),
        (["profile", "--hf-config", "lama"], "Did you mean 'llama'"),
        (["profile", "--hf-config", "no/such/config.json"], "no such file or folder"),
        (["profile", "--hf-config", "t5"], "no causal-LM, masked-LM or image-classification"),
        (["profile", "--hf-config", "llama", "--set", "hiden_size=8"], "'hidden_size'"),
        (["profile", "--hf-config", "llama", "--size", "tiny"], "--size applies to the named"),
        (["profile", "--hf-config", "llama", "--set", "hidden_size=30"], "LlamaConfig rejects"),
        (["profile", "gpt2", "--plot", "out.pdf"], "expected a .png path"),
        (["profile", "gpt2", "--plot", "no/such/dir/out.png"], "folder does not exist"),
        (["profile", "pkg:fn", "--size", "tiny"], "--size applies to the named"),
        (["profile", "not a module:fn"], "bad MODULE:FACTORY target"),
        (["profile", "no_such_module_xyz:build"], "cannot import module 'no_such_module_xyz'"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(argv, match, capsys, monkeypatch):
    import slimgrad.profile

    def no_work(*a, **k):
        raise AssertionError("a bad argument must stop the command before any work")

    monkeypatch.setattr(slimgrad.profile, "profile", no_work)
    monkeypatch.setattr(slimgrad.profile, "fit", no_work)
    monkeypatch.setattr(cli, "_have_matplotlib", lambda: True)
    _one_line_error(capsys, argv, match)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_measured_cuda_without_a_gpu(capsys):
    _one_line_error(capsys, ["profile", "gpt2", "--device", "cuda"], "needs a CUDA GPU")


def test_plot_without_matplotlib_stops_before_the_run(capsys, monkeypatch, tmp_path):
    import slimgrad.profile

    monkeypatch.setattr(cli, "_have_matplotlib", lambda: False)
    monkeypatch.setattr(slimgrad.profile, "profile", lambda *a, **k: 1 / 0)
    line = _one_line_error(capsys, ["profile", "gpt2", "--plot", str(tmp_path / "p.png")])
    assert "--plot needs matplotlib" in line and "pip install 'slimgrad[plot]'" in line


def test_demo_without_matplotlib_runs_without_the_plot(capsys, monkeypatch):
    import slimgrad.demo

    calls = []
    monkeypatch.setattr(cli, "_have_matplotlib", lambda: False)
    monkeypatch.setattr(slimgrad.demo, "run_demo", lambda **kw: calls.append(kw) or {"ok": True})
    assert main(["demo", "--small"]) == 0
    assert calls == [{"steps": 5, "small": True, "out": None}]
    assert "pip install 'slimgrad[plot]'" in capsys.readouterr().err


def test_plot_extra_declared():
    import tomllib

    root = Path(cli.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["plot"] == ["matplotlib>=3.7"]
    assert "matplotlib>=3.7" in extras["dev"]


# -------------------------------------------------------------------------- module:factory
_FACTORIES = """
import torch

def build():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    return model, lambda batch: torch.randn(batch, 8)

def broken():
    raise RuntimeError("no weights here")

def not_a_pair():
    return 3

def bad_inputs():
    return torch.nn.Linear(3, 4), lambda batch: torch.randn(batch, 5)

NOT_CALLABLE = 1
"""


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    # a module in the current directory only (not on sys.path, as for a user's script)
    name = f"user_model_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_FACTORIES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def test_factory_from_the_current_directory(factory_dir, capsys):
    assert main(["profile", f"{factory_dir}:build", "--batch", "5", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    # eager saves the GELU input (5x16 fp32), its output kept by the last Linear, and the output
    # (the default loss squares it)
    assert rec["target"] == f"{factory_dir}:build" and rec["batch"] == 5
    assert rec["eager"]["saved_bytes"] == 2 * 5 * 16 * 4 + 5 * 4
    assert main(["estimate", f"{factory_dir}:build", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] == 1  # a factory's default batch


@pytest.mark.parametrize(
    "fn, match",
    [
        ("broken", "factory '{m}:broken' raised; expected broken() to return (model, make_inputs)"),
        ("not_a_pair", "must return (model, make_inputs)"),
        ("nothere", "module '{m}' has no factory 'nothere'"),
        ("NOT_CALLABLE", "expected a function, got int"),
        ("bad_inputs", "failed while its model was built or run"),
    ],
)
def test_factory_errors_are_one_line(factory_dir, fn, match, capsys):
    argv = ["profile", f"{factory_dir}:{fn}", "--no-convert"]
    line = _one_line_error(capsys, argv, after_progress=fn == "bad_inputs")
    assert match.format(m=factory_dir) in line
    assert "--help" in line or "Define" in line or "Return" in line


def test_console_script_imports_from_cwd_and_prints_no_traceback(factory_dir, tmp_path):
    script = Path(sys.executable).with_name("slimgrad")
    if not script.is_file():
        pytest.skip("the slimgrad console script is not installed next to this Python")
    r = subprocess.run([str(script), "profile", f"{factory_dir}:broken"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        f"slimgrad profile: factory '{factory_dir}:broken' raised; expected broken() to return "
        "(model, make_inputs), got RuntimeError: no weights here. Call broken() in Python to see "
        "the traceback; the contract is in `slimgrad profile --help`."
    )


# ------------------------------------------------------------------------------- --hf-config
def test_hf_config_model_type_with_set(capsys):
    argv = ["estimate", "--hf-config", "llama", *_sets(_TINY_LLAMA), "--seq", "8", "--batch", "2"]
    assert main([*argv, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["target"] == "hf-config:llama" and one["batch"] == 2 and one["estimated"]
    assert 0 < one["slimgrad"]["saved_bytes"] < one["eager"]["saved_bytes"]
    # --set reaches the model: a second layer saves more
    two_layers = [f for f in _TINY_LLAMA if not f.startswith("num_hidden_layers")]
    argv2 = ["estimate", "--hf-config", "llama", *_sets(two_layers), "--set", "num_hidden_layers=2"]
    assert main([*argv2, "--seq", "8", "--batch", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["eager"]["saved_bytes"] > one["eager"]["saved_bytes"]


def test_hf_config_file_and_folder(tmp_path, capsys):
    from transformers import AutoConfig

    from slimgrad.profile import hf_config_target, parse_config_overrides

    cfg = AutoConfig.for_model("llama", **parse_config_overrides(type(AutoConfig.for_model(
        "llama")), _TINY_LLAMA))  # fmt: skip
    cfg.save_pretrained(tmp_path)
    t = hf_config_target(str(tmp_path / "config.json"), seq=8, overrides=["num_hidden_layers=2"])
    model = t.build()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    assert main(["profile", "--hf-config", str(tmp_path), "--seq", "8", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hf-config:{tmp_path}, batch 1, cpu kernels (measured)")
    (tmp_path / "config.json").write_text("{not json")
    _one_line_error(capsys, ["profile", "--hf-config", str(tmp_path)], "cannot read")


def test_parse_config_overrides_types():
    from transformers import GPT2Config

    from slimgrad.profile import parse_config_overrides

    got = parse_config_overrides(
        GPT2Config,
        ["n_layer=3", "resid_pdrop=0.25", "attn_pdrop=0", "use_cache=False", "n_inner=None",
         "eos_token_id=[1, 2]", "activation_function=relu"],
    )  # fmt: skip
    assert got == {
        "n_layer": 3, "resid_pdrop": 0.25, "attn_pdrop": 0, "use_cache": False, "n_inner": None,
        "eos_token_id": [1, 2], "activation_function": "relu",
    }  # fmt: skip
    assert type(got["n_layer"]) is int and type(got["resid_pdrop"]) is float
    with pytest.raises(ValueError, match="expected an integer, got 'abc'"):
        parse_config_overrides(GPT2Config, ["n_layer=abc"])


# ------------------------------------------------------------------------------ the search
class _Synthetic:
    # stands in for profile(..., fake=True): bytes given by a function of the batch per side
    def __init__(self, eager, slim):
        self.fns, self.calls = {"eager": eager, "slimgrad": slim}, []

    def __call__(self, target, *, batch, convert, **kw):
        from types import SimpleNamespace as NS

        self.calls.append((batch, convert))
        eager = NS(peak_bytes=self.fns["eager"](batch))
        slim = NS(peak_bytes=self.fns["slimgrad"](batch)) if convert else None
        return NS(resident_bytes=1000, eager=eager, converted=slim)


@pytest.mark.parametrize(
    "eager, slim",
    [
        (lambda b: 300 * b, lambda b: 170 * b),  # affine
        (lambda b: 40 * b * b + 7 * b, lambda b: 25 * b * b),  # convex
        (lambda b: 9000 * math.isqrt(b), lambda b: 5000 * math.isqrt(b)),  # concave, steps
        (lambda b: 1000 * (b // 7) + 3 * b, lambda b: 700 * (b // 5) + b),  # staircase
    ],
)
@pytest.mark.parametrize("budget", [900, 1001, 1170, 5_000, 123_457, 10**9])
def test_fit_finds_the_largest_batch_of_each_side(eager, slim, budget, monkeypatch):
    import slimgrad.profile as P

    fake = _Synthetic(eager, slim)
    monkeypatch.setattr(P, "profile", fake)
    target = P.Target("t", lambda skip_init=False: None, lambda b: None, 1)
    r = P.fit(target, budget, max_batch=5000)

    def brute(fn):
        fits = [b for b in range(1, 5001) if 1000 + fn(b) <= budget]
        return max(fits, default=0)

    assert (r.slimgrad_batch, r.eager_batch) == (brute(slim), brute(eager))
    assert len(fake.calls) <= 60  # far fewer than the 5000 batches
    # a converted probe also gives eager's bytes: no batch is estimated twice
    assert len({b for b, _ in fake.calls}) == len(fake.calls)


def test_fit_settles_affine_bytes_in_few_probes(monkeypatch):
    import slimgrad.profile as P

    fake = _Synthetic(lambda b: 3_000_000 + 41_000 * b, lambda b: 2_000_000 + 23_000 * b)
    monkeypatch.setattr(P, "profile", fake)
    target = P.Target("t", lambda skip_init=False: None, lambda b: None, 1)
    r = P.fit(target, 2**30, max_batch=1 << 16)
    assert r.slimgrad_batch == (2**30 - 1000 - 2_000_000) // 23_000
    assert r.eager_batch == (2**30 - 1000 - 3_000_000) // 41_000
    # batches 1 and 2, the line's guess and the next batch; eager: its guess and the next
    assert len(fake.calls) == 6

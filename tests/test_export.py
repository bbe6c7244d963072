"""Checkpoints without our package: every zoo checkpoint loads in plain transformers with trust_remote_code.

Each architecture is saved through `models.save_checkpoint` with the bundled tokenizer, then loaded in a
subprocess where `models`, `parallel`, `train` and `eval` cannot be imported (the package is installed
editable, so a meta-path finder would find it from any directory: the names are set to None in
`sys.modules`, which makes every import of them fail; `python -I` keeps the working directory and
PYTHONPATH off `sys.path`). Every import in there goes through transformers' dynamic-module loader
into a temporary HF_MODULES_CACHE, so nothing is written to ~/.cache.

Tolerance: logits must be identical (the same code on the same weights in fp32).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import models
from models.export import _rewrite, build_remote_code
from train.data import load_tokenizer

ARCHS = sorted(models.ZOO)
REPO = Path(__file__).resolve().parents[1]
PROMPT = "To be, or not to be"
NEW_TOKENS = 6

# First lines of every subprocess: the overlap-zoo packages cannot be imported.
BLOCK_PACKAGE = textwrap.dedent(
    """\
    import sys
    for _name in ("models", "parallel", "train", "eval"):
        sys.modules[_name] = None  # `import models` (and any submodule) now raises ImportError
    try:
        import models
    except ImportError:
        pass
    else:
        raise SystemExit("the models package is still importable")
    """
)

# Loads every exported checkpoint given on the command line without the package; writes what it saw.
LOAD_SCRIPT = BLOCK_PACKAGE + textwrap.dedent(
    """\
    import json, traceback
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM, pipeline

    root, prompt, new_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    ids = torch.load(root / "ids.pt")
    report = {}
    for arch in sys.argv[4:]:
        seen = report[arch] = {}
        try:
            model = AutoModelForCausalLM.from_pretrained(root / arch, trust_remote_code=True).eval()
            seen["class"] = f"{type(model).__module__}.{type(model).__name__}"
            with torch.no_grad():
                torch.save(model(ids).logits, root / f"{arch}.logits.pt")
            generate = pipeline("text-generation", model=str(root / arch), trust_remote_code=True)
            out = generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_tensors=True)
            seen["pipeline_ids"] = [int(i) for i in out[0]["generated_token_ids"]]
            # A model loaded from remote code saves with its code (transformers copies the sibling files).
            model.save_pretrained(root / f"{arch}_resaved")
            again = AutoModelForCausalLM.from_pretrained(root / f"{arch}_resaved", trust_remote_code=True).eval()
            with torch.no_grad():
                torch.save(again(ids).logits, root / f"{arch}.resaved_logits.pt")
        except Exception:
            seen["error"] = traceback.format_exc()
    (root / "report.json").write_text(json.dumps(report))
    """
)


def run_without_package(
    script: str, *args: str, cwd: Path, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run `script` with this interpreter, offline, the package blocked, HF modules cached under `cwd`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(cwd / "hf_modules"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-I", "-c", script, *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,  # transformers asks about remote code on a terminal; here it must not wait
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    """{arch: in-process model} saved under a temporary root, plus one run of LOAD_SCRIPT over all of them."""
    root = tmp_path_factory.mktemp("export")
    ids = torch.randint(0, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(1))
    torch.save(ids, root / "ids.pt")
    saved = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = models.ZOO[arch].model_class(models.ZOO[arch].tiny(vocab_size=len(tokenizer))).eval()
        models.save_checkpoint(model, tokenizer, root / arch)
        saved[arch] = model
    out = run_without_package(LOAD_SCRIPT, str(root), PROMPT, str(NEW_TOKENS), *ARCHS, cwd=root)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads((root / "report.json").read_text())
    return root, ids, saved, report


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_without_package(arch, exported):
    root, ids, saved, report = exported
    seen = report[arch]
    assert "error" not in seen, seen["error"]
    model_type = saved[arch].config.model_type
    # The class came from the checkpoint's own code, through transformers' dynamic modules.
    assert seen["class"].startswith("transformers_modules.")
    assert seen["class"].endswith(f".modeling_{model_type}.{type(saved[arch]).__name__}")
    with torch.no_grad():
        expected = saved[arch](ids).logits
    assert torch.equal(torch.load(root / f"{arch}.logits.pt"), expected)
    assert torch.equal(torch.load(root / f"{arch}.resaved_logits.pt"), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_generates_without_package(arch, exported, tokenizer):
    root, _, saved, report = exported
    assert "error" not in report[arch], report[arch]["error"]
    # The pipeline encodes the prompt without special tokens and generates greedily with the saved
    # generation config: the in-process model must produce the same ids.
    prompt = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    expected = saved[arch].generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    assert report[arch]["pipeline_ids"] == expected[0].tolist()


# Loads each folder named on the command line without the package and saves its logits on the saved ids.
PLAIN_LOAD_SCRIPT = BLOCK_PACKAGE + textwrap.dedent(
    """\
    from pathlib import Path
    import torch
    from transformers import AutoModelForCausalLM

    root = Path(sys.argv[1])
    ids = torch.load(root / "ids.pt")
    for name in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(root / name, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(ids).logits, root / f"{name}.logits.pt")
    """
)


def test_plain_save_pretrained_writes_the_code(tmp_path):
    """`model.save_pretrained(dir)` (no tokenizer, not through save_checkpoint) writes the code and `auto_map` too:
    the ladder variants, whose class is their standard sibling's, load without the package to the same logits."""
    names = ["llama", *models.variants()]
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    saved = {}
    for name in names:
        torch.manual_seed(0)
        saved[name] = models.get(name).model_class(models.get(name).tiny()).eval()
        saved[name].save_pretrained(tmp_path / name)
        assert "auto_map" in json.loads((tmp_path / name / "config.json").read_text())
    out = run_without_package(PLAIN_LOAD_SCRIPT, str(tmp_path), *names, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    for name, model in saved.items():
        with torch.no_grad():
            assert torch.equal(torch.load(tmp_path / f"{name}.logits.pt"), model(ids).logits), name


def test_config_names_the_bundled_code(exported):
    root, _, saved, _ = exported
    for arch, model in saved.items():
        model_type = model.config.model_type
        config = json.loads((root / arch / "config.json").read_text())
        assert config["auto_map"] == {
            "AutoConfig": f"configuration_{model_type}.{type(model.config).__name__}",
            "AutoModel": f"modeling_{model_type}.{model.base_model_class.__name__}",
            "AutoModelForCausalLM": f"modeling_{model_type}.{type(model).__name__}",
        }
        for name in ("configuration", "modeling"):
            assert (root / arch / f"{name}_{model_type}.py").is_file()
        assert "trust_remote_code=True" in (root / arch / "README.md").read_text()
        # The in-memory config is left as it was: only the saved file names the code.
        assert not hasattr(model.config, "auto_map")


def test_loading_without_trust_remote_code_says_what_to_do(exported):
    root = exported[0]
    script = BLOCK_PACKAGE + textwrap.dedent(
        """\
        from transformers import AutoModelForCausalLM
        AutoModelForCausalLM.from_pretrained(sys.argv[1])
        """
    )
    out = run_without_package(script, str(root / "llama"), cwd=root)
    assert out.returncode != 0
    last_line = out.stderr.strip().splitlines()[-1]
    assert "trust_remote_code=True" in last_line, out.stderr[-2000:]


def test_lm_eval_hf_model_runs_without_package(exported, tmp_path):
    """lm-eval's own "hf" model (not our adapter) evaluates an exported checkpoint on a bundled task, offline."""
    root = exported[0]
    script = (
        BLOCK_PACKAGE + "from lm_eval.__main__ import cli_evaluate\nsys.argv[0] = 'lm_eval'\ncli_evaluate()\n"
    )
    args = [
        "run",
        "--model", "hf",
        "--model_args", f"pretrained={root / 'kraken'},trust_remote_code=True,dtype=float32",
        "--include_path", str(REPO / "eval" / "tasks"),
        "--tasks", "shakespeare_cloze",
        "--limit", "3",
        "--device", "cpu",
        "--batch_size", "4",
        "--output_path", str(tmp_path / "results"),
    ]  # fmt: skip
    out = run_without_package(script, *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["shakespeare_cloze"]["effective"] == 3
    assert 0.0 <= results["results"]["shakespeare_cloze"]["acc,none"] <= 1.0


def test_export_refuses_code_it_cannot_make_self_contained():
    with pytest.raises(
        ValueError, match=r"\['parallelize'\] from parallel, which the stand-in .* has \['comm'\]"
    ):
        _rewrite("from parallel import parallelize\n", "models.fake.modeling", {})
    with pytest.raises(ValueError, match=r"`import models.llama` cannot be exported"):
        _rewrite("import models.llama\n", "models.fake.modeling", {})
    with pytest.raises(ValueError, match=r"imports train.data: model code may not depend on it"):
        _rewrite("def f():\n    from train.data import load_tokenizer\n", "models.fake.modeling", {})
    # What it can rewrite, it rewrites in place (here: an import inside a function).
    source, imported = _rewrite("def f():\n    from models.common.norm import RMSNorm  # why\n", "m", {})
    assert source == "def f():\n    from .zoo_common_norm import RMSNorm  # why\n"
    assert imported == ["models.common.norm"]
    with pytest.raises(ValueError, match="only zoo architectures"):
        from transformers import LlamaForCausalLM

        build_remote_code(LlamaForCausalLM)


def test_export_into_a_used_folder_replaces_the_old_code(tmp_path, tokenizer):
    for arch in ("kraken", "llama"):
        torch.manual_seed(0)
        models.save_checkpoint(models.ZOO[arch].model_class(models.ZOO[arch].tiny()), tokenizer, tmp_path)
    written = {p.name for p in tmp_path.glob("*.py")}
    assert written == set(build_remote_code(models.ZOO["llama"].model_class).files)
    assert "modeling_zoo_kraken.py" not in written

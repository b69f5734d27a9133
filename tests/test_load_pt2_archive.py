"""A .pt2 never runs code unless the user trusts it (issue 13.1).

Every attack here is a real archive: torch.export.save of a small model, then members rewritten
the way an attacker would. Each payload demonstrably runs through a plain torch.export.load
(the first test checks one); qlint must refuse the archive before torch sees it, with exit 2
and one line naming the member, and the payload must not have run.
"""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn as nn

from qlint.core.archive import EXPANSION_ALLOWANCE_BYTES
from qlint.core.load import load_model
from qlint.errors import LoadError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


class _WritesMarker:
    """Unpickling this calls open(path, 'w'): the file appears only if the pickle is executed."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


class _FullTensor:
    """A harmless pickle that still needs more than weights_only: it calls torch.full."""

    def __init__(self, shape, value):
        self.shape, self.value = shape, value

    def __reduce__(self):
        return (torch.full, (self.shape, self.value))


class _FullParameter(_FullTensor):
    def __reduce__(self):
        return (nn.Parameter, (_FullTensor(self.shape, self.value),))


@pytest.fixture(scope="module")
def base_archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "model.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(_Net().eval(), (torch.randn(2, 4),)), str(path))
    return path


def _rewrite(src, dst, edit):
    """Copy the archive with ``edit(members, root)`` applied to its {name: bytes}."""
    with zipfile.ZipFile(src) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    root = next(iter(members)).split("/")[0]
    edit(members, root)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return dst


def _edit_config(members, root, kind, change):
    name = f"{root}/data/{kind}/model_{kind}_config.json"
    config = json.loads(members[name])
    change(config["config"])
    members[name] = json.dumps(config).encode()


def _edit_program(members, root, change):
    name = f"{root}/models/model.json"
    program = json.loads(members[name])
    change(program)
    members[name] = json.dumps(program).encode()


def _pickled_weight(payload):
    def edit(members, root):
        def mark(config):
            config["fc.bias"]["use_pickle"] = True
            members[f"{root}/data/weights/{config['fc.bias']['path_name']}"] = payload

        _edit_config(members, root, "weights", mark)

    return edit


def _weight_behind_absolute_name(payload):
    """fc.bias marked for pickling under the name '/w': torch joins it with os.path.join and reads
    the member '<root>//w' (the payload), while '<root>/data/weights//w' holds a plain tensor."""

    def edit(members, root):
        _edit_config(members, root, "weights", lambda config: config["fc.bias"].update(use_pickle=True, path_name="/w"))
        members[f"{root}/data/weights//w"] = _saved(torch.zeros(3))
        members[f"{root}//w"] = payload

    return edit


def _inputs_in_upper_case(payload):
    """torch's zip reader finds data/sample_inputs/model.pt under the name MODEL.pt too."""

    def edit(members, root):
        del members[f"{root}/data/sample_inputs/model.pt"]
        members[f"{root}/data/sample_inputs/MODEL.pt"] = payload

    return edit


def _saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _guard(code):
    return lambda members, root: _edit_program(members, root, lambda p: p.__setitem__("guards_code", [code]))


def _refusal_line(result, archive):
    """The one error line the CLI printed for ``archive`` (several models are linted in one run)."""
    lines = [line for line in result.stderr.splitlines() if str(archive) in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("qlint: error:") and "Traceback" not in result.stderr
    return lines[0]


def _run_launcher(tmp_path, *args, env=None):
    """The console script's way in (no working directory on sys.path), reporting one import at exit."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "import sys\nfrom qlint.cli.main import main\ncode = main(sys.argv[1:])\n"
        "print('IMPORTED' if 'torch.utils.benchmark' in sys.modules else 'NOT IMPORTED', "
        "file=sys.stderr)\nsys.exit(code)\n"
    )
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))  # no empty entry: that is cwd
    full_env = dict(os.environ, PYTHONPATH=path, **(env or {}))
    return subprocess.run(
        [sys.executable, str(launcher), *map(str, args)],
        cwd=tmp_path,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --------------------------------------------------------------------------- the attacks
def _opaque_constant(marker):
    def edit(members, root):
        def add(config):
            config["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}

        _edit_config(members, root, "constants", add)
        members[f"{root}/data/constants/opaque_obj_0"] = pickle.dumps(_WritesMarker(marker))

    return edit


def _example_inputs(payload):
    return lambda members, root: members.__setitem__(f"{root}/data/sample_inputs/model.pt", payload)


def _aoti_library(library):
    def edit(members, root):
        folder = f"{root}/data/aotinductor/model/"
        members[folder + "model.wrapper.so"] = library
        members[folder + "model.wrapper.cpp"] = b"// compiled model"
        members[folder + "model.wrapper_metadata.json"] = json.dumps({"AOTI_DEVICE_KEY": "cpu"}).encode()

    return edit


def _native_library(folder):
    """A shared library whose constructor creates $QLINT_TEST_MARKER (a real one when cc exists)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return b"\x7fELF not a real library"
    source = folder / "payload.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n__attribute__((constructor)) static void run(void) "
        '{ const char *p = getenv("QLINT_TEST_MARKER"); FILE *f = p ? fopen(p, "w") : 0; '
        "if (f) fclose(f); }\n"
    )
    built = folder / "payload.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(built), str(source)], check=True)
    return built.read_bytes()


def _printing_operator(program):
    """An op torch resolves and runs on every forward: print to stdout (JSON and SARIF break)."""
    program["graph_module"]["graph"]["nodes"].insert(
        0,
        {
            "target": "torch.ops.higher_order.print",
            "name": "injected",
            "is_hop_single_tensor_return": None,
            "inputs": [{"name": "format_str", "arg": {"as_string": "INJECTED-BY-ARCHIVE"}, "kind": 1}],
            "outputs": [{"as_none": True}],
            "metadata": {},
        },
    )


def _shape_expression(code):
    def change(program):  # torch parses size expressions with sympy.sympify, an eval
        program["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0] = {
            "as_expr": {"expr_str": code, "hint": {"as_int": 2}}
        }

    return change


def _defaultdict_spec(module):
    def change(program):  # torch rebuilds a defaultdict spec with importlib.import_module(module)
        signature = program["graph_module"]["module_call_graph"][0]["signature"]
        spec = json.loads(signature["in_spec"])
        spec[1]["children_spec"][1] = {
            "type": "collections.defaultdict",
            "children_spec": [],
            "context": {"default_factory_module": module, "default_factory_name": "factory", "dict_context": []},
        }
        signature["in_spec"] = json.dumps(spec)

    return change


def _source_function(name):
    def change(program):  # torch resolves it with hasattr/getattr from torch: a lazy submodule import
        program["graph_module"]["graph"]["nodes"][0]["metadata"]["source_fn_stack"] = f"linear,{name}"

    return change


def _retyped(program):
    for node in program["graph_module"]["graph"]["nodes"]:
        stack = node["metadata"].get("nn_module_stack")
        if stack:
            node["metadata"]["nn_module_stack"] = stack.replace(
                "torch.nn.modules.linear.Linear", "torch.utils.benchmark.Timer"
            )


def _add_bomb(path):
    root = zipfile.ZipFile(path).namelist()[0].split("/")[0]
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as archive:
        with archive.open(f"{root}/extra/bomb.txt", "w", force_zip64=True) as member:
            zeros = bytes(2**20)
            for _ in range(3 * EXPANSION_ALLOWANCE_BYTES // len(zeros)):  # zeros deflate about 1000:1
                member.write(zeros)
    return path


@pytest.fixture(scope="module")
def attacks(base_archive, tmp_path_factory):
    """Every crafted archive, linted in ONE run of the CLI (one torch import for all of them)."""
    folder = tmp_path_factory.mktemp("attacks")
    marker = folder / "payload-ran.txt"
    # importable next to the launcher, as a module in any folder on sys.path would be
    (folder / "qlint_payload_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nfactory = dict\n")
    archives = {
        "pickled_weight": _rewrite(
            base_archive, folder / "weight.pt2", _pickled_weight(pickle.dumps(_WritesMarker(marker)))
        ),
        "opaque": _rewrite(base_archive, folder / "opaque.pt2", _opaque_constant(marker)),
        "inputs": _rewrite(base_archive, folder / "inputs.pt2", _example_inputs(pickle.dumps(_WritesMarker(marker)))),
        "absolute_name": _rewrite(
            base_archive, folder / "absolute.pt2", _weight_behind_absolute_name(pickle.dumps(_WritesMarker(marker)))
        ),
        "upper_case": _rewrite(
            base_archive, folder / "upper.pt2", _inputs_in_upper_case(pickle.dumps(_WritesMarker(marker)))
        ),
        "aoti": _rewrite(base_archive, folder / "aoti.pt2", _aoti_library(_native_library(folder))),
        "guard": _rewrite(
            base_archive, folder / "guard.pt2", _guard(f"__import__('os').system('touch {marker}') == 0")
        ),
        "operator": _rewrite(
            base_archive, folder / "operator.pt2", lambda m, r: _edit_program(m, r, _printing_operator)
        ),
        "expression": _rewrite(
            base_archive,
            folder / "expression.pt2",
            lambda m, r: _edit_program(m, r, _shape_expression(f"__import__('os').system('touch {marker}')")),
        ),
        "treespec": _rewrite(
            base_archive,
            folder / "treespec.pt2",
            lambda m, r: _edit_program(m, r, _defaultdict_spec("qlint_payload_module")),
        ),
        "source_fn": _rewrite(
            base_archive,
            folder / "source_fn.pt2",
            lambda m, r: _edit_program(m, r, _source_function("torch.onnx.export")),
        ),
        "bomb": _add_bomb(shutil.copy(base_archive, folder / "bomb.pt2")),
        "trust_needed": _rewrite(base_archive, folder / "trust_needed.pt2", _guard("len(L['x'].size()) == 2")),
        "retyped": _rewrite(base_archive, folder / "retyped.pt2", lambda m, r: _edit_program(m, r, _retyped)),
    }
    result = _run_launcher(
        folder,
        *archives.values(),
        "--random-calibration",
        "1",
        "--format",
        "json",
        env={"QLINT_TEST_MARKER": str(marker)},
    )
    return archives, result, marker


@pytest.mark.parametrize("attack", [_pickled_weight, _weight_behind_absolute_name, _inputs_in_upper_case])
def test_payload_runs_under_plain_torch_load(base_archive, tmp_path, attack):
    """The attacks are real: torch.export.load itself executes the payload."""
    marker = tmp_path / "ran.txt"
    path = _rewrite(base_archive, tmp_path / "evil.pt2", attack(pickle.dumps(_WritesMarker(marker))))
    with pytest.raises(Exception):  # noqa: B017 -- whatever torch raises, as long as it refuses
        torch.export.load(str(path))
    assert marker.exists()


def test_no_payload_ran(attacks):
    archives, result, marker = attacks
    assert result.returncode == 2, result.stderr
    assert not marker.exists(), "code from an archive ran"
    assert "INJECTED-BY-ARCHIVE" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "attack, member, reason",
    [
        ("pickled_weight", "data/weights/weight_1", "weight 'fc.bias' (marked for pickle loading)"),
        ("opaque", "data/constants/opaque_obj_0", "opaque Python object"),
        ("inputs", "data/sample_inputs/model.pt", "example inputs cannot be loaded as plain tensors"),
        ("absolute_name", "data/weights/model_weights_config.json", "the payload name '/w', not a file in"),
        ("upper_case", "data/sample_inputs/MODEL.pt", "example inputs cannot be loaded as plain tensors"),
        ("aoti", "data/aotinductor/model/model.wrapper.so", "native code"),
        ("guard", "models/model.json", "guard code"),
        ("operator", "models/model.json", "'torch.ops.higher_order.print'"),
        ("expression", "models/model.json", "shape expression"),
        ("treespec", "models/model.json", "factory module 'qlint_payload_module'"),
        ("source_fn", "models/model.json", "'torch.onnx.export'"),
        ("trust_needed", "models/model.json", "calls 'len'"),
    ],
)
def test_refused_with_the_member_and_why(attacks, attack, member, reason):
    archives, result, _ = attacks
    line = _refusal_line(result, archives[attack])
    assert f"/{member}:" in line and reason in line and "--trust-pickle" in line, line


def test_zip_bomb_refused_even_when_trusted(attacks):
    archives, result, _ = attacks
    assert archives["bomb"].stat().st_size < EXPANSION_ALLOWANCE_BYTES / 100
    line = _refusal_line(result, archives["bomb"])
    assert "extra/bomb.txt" in line and "would unpack to" in line, line
    with pytest.raises(LoadError, match="extra/bomb.txt"):
        load_model(str(archives["bomb"]), trust_pickle=True)


def test_archive_type_names_are_never_imported(attacks):
    """nn_module_stack type strings are labels: naming an unloaded torch module lints, imports nothing."""
    archives, result, _ = attacks
    assert not [line for line in result.stderr.splitlines() if str(archives["retyped"]) in line]
    assert result.stderr.strip().splitlines()[-1] == "NOT IMPORTED"


def test_one_archive_one_line_exit_2(run_cli, attacks):
    archives, _, marker = attacks
    result = run_cli(archives["pickled_weight"], "-q")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "weight_1" in lines[0] and not marker.exists()


def test_trusted_pickled_weight_loads(base_archive, tmp_path):
    benign = _saved(_FullParameter((3,), 0.5))
    path = _rewrite(base_archive, tmp_path / "trusted.pt2", _pickled_weight(benign))
    with pytest.raises(LoadError, match="fc.bias"):
        load_model(str(path))
    loaded = load_model(str(path), trust_pickle=True)
    assert torch.equal(loaded.module.fc.bias.detach(), torch.full((3,), 0.5))


def test_trusted_archive_lints_through_the_cli(run_cli, base_archive, tmp_path):
    """Example inputs and guard code that need trust: refused above, linted with --trust-pickle."""
    benign_inputs = _saved(((_FullTensor((2, 4), 0.25),), {}))
    inputs = _rewrite(base_archive, tmp_path / "inputs.pt2", _example_inputs(benign_inputs))
    with pytest.raises(LoadError, match="example inputs"):
        load_model(str(inputs))
    guarded = _rewrite(inputs, tmp_path / "guarded.pt2", _guard("len(L['x'].size()) == 2"))
    result = run_cli(guarded, "--trust-pickle", "--random-calibration", "1", "--format", "json")
    assert result.returncode in (0, 1), result.stderr
    assert json.loads(result.stdout)["model"].endswith("guarded.pt2")


def test_dynamic_shape_export_still_loads(tmp_path):
    """Plain exports keep loading: shape expressions, guard code and sym ops of a dynamic export."""

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x)
            return y.reshape(y.shape[0], -1).mean(1), x.shape[0] // 2

    path = tmp_path / "dynamic.pt2"
    dynamic = {"x": {0: torch.export.Dim("batch", min=2, max=64), 2: torch.export.Dim.AUTO}}
    program = torch.export.export(Pool(), (torch.randn(4, 3, 8, 8),), dynamic_shapes=dynamic)
    torch.export.save(program, str(path))
    loaded = load_model(str(path))
    assert loaded.exported_program._guards_code, "the export should carry guard code for this test"
    assert loaded.module(torch.randn(6, 3, 9, 8))[0].shape == (6,)

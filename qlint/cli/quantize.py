"""``qlint quantize``: build the int8 model a plan gives, as ``qlint verify`` measured it, and save it.

    qlint quantize MODEL [--plan plan.json] --calibration DATA --output int8.pt|int8.pt2 [--eval-data DATA]

A module:factory or .pt model is quantized with ``QuantPlan.quantize`` (prepare_fx) and saved
as TorchScript (.pt); an exported (aten) graph such as a .pt2 with the pt2e flow, by the code
verify measures it with (:func:`qlint.advice.verify_pt2e.build_pt2e`), and saved with
torch.export (.pt2), which ``torch.export.load`` reads after ``import torchao``. Every user
error is a QlintError: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qlint.cli.common import Parser, check_outputs, user_output_to_stderr, write_stdout
from qlint.cli.verify import load_model_and_plan, model_arguments
from qlint.errors import ConfigError, QlintError, first_line
from qlint.render.literal import printable

# torch.export.load of a pt2e int8 .pt2 in a fresh process fails (SerializeError: no op
# quantized_decomposed.dequantize_per_channel) until something defines those ops; torch's own
# definitions sit in a private module, torchao's pt2e package (the qlint[pt2e] extra) loads them.
PT2E_LOAD_IMPORT = "`import torchao`"


def _quantize_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qlint quantize",
        description="Build the int8 model a plan gives (what qlint verify measured) and save it.",
    )
    model_arguments(parser)
    parser.add_argument("--calibration", required=True, metavar="DATA", help="the batches to calibrate on")
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="OUT.pt|OUT.pt2",
        help="the int8 model: .pt, TorchScript (torch.jit.load reads it), for a module:factory or .pt model; "
        ".pt2, torch.export, for a .pt2 model, quantized with the pt2e flow (torch.export.load reads it after "
        f"{PT2E_LOAD_IMPORT}: its graph calls quantized_decomposed ops, which torchao registers)",
    )
    parser.add_argument(
        "--eval-data", metavar="DATA", help="batches to report the output SQNR against the float model on"
    )
    return parser


def _output_sqnr(model: Any, converted: Any, eval_data: Any) -> float | None:
    """Output SQNR of ``converted`` against (an eval-mode copy of) the float ``model``."""
    import copy

    import torch

    from qlint.core.batches import call_model
    from qlint.core.ops import is_aten_graph
    from qlint.core.sqnr import SqnrSums

    # an exported module refuses .eval(): it runs in the mode it was exported in
    reference, sums = copy.deepcopy(model), SqnrSums()
    if not is_aten_graph(reference):
        reference.eval()
    with torch.no_grad():
        for batch in eval_data:
            sums.add(call_model(reference, batch), call_model(converted, batch))
    return sums.sqnr_db()


def _save_int8(converted: Any, example: Any, out: Path) -> str:
    """TorchScript: a pickled converted GraphModule does not load back (torch rebuilds the graph
    before its quantized modules have their state), a scripted one does, with torch.jit.load.
    Where scripting fails (annotations TorchScript cannot read), the model is traced on
    ``example`` instead. Returns how it was saved."""
    import torch

    from qlint.core.batches import as_call

    how = "scripted"
    try:
        scripted = torch.jit.script(converted)
    except Exception as script_error:  # TorchScript rejects some Python constructs, in many exception types
        args, kwargs = as_call(example, what="calibration batch 0")
        try:
            with torch.no_grad():
                scripted = torch.jit.trace(converted, args or None, example_kwarg_inputs=kwargs or None)
        except Exception as error:  # tracing fails in as many ways
            raise QlintError(
                f"cannot save the int8 model as TorchScript: {first_line(script_error)}; tracing: {first_line(error)}"
            ) from error
        how = "traced on calibration batch 0, so its control flow is that batch's"
    try:
        torch.jit.save(scripted, str(out))
    except (OSError, RuntimeError) as error:
        raise QlintError(f"cannot write {out}: {first_line(error)}") from error
    return how


def _save_exported(converted: Any, example: Any, program: Any, out: Path) -> None:
    """The pt2e int8 model as a .pt2: torch.export of ``converted`` on ``example`` (with the
    dynamic dimensions of the float ``program``, where it had any), then torch.export.save."""
    import torch

    from qlint.core.batches import as_call

    args, kwargs = as_call(example, what="calibration batch 0")
    try:
        exported = torch.export.export(
            converted, tuple(args), kwargs=kwargs or None, dynamic_shapes=_dynamic_dims(program, args, kwargs)
        )
        torch.export.save(exported, str(out))
    except OSError as error:
        raise QlintError(f"cannot write {out}: {error.strerror}") from error
    except Exception as error:  # export failures come in many types
        raise QlintError(f"cannot export the int8 model: {first_line(error)}") from error


def _dynamic_dims(program: Any, args: Any, kwargs: Any) -> Any:
    """torch.export's dynamic_shapes for the inputs: Dim.AUTO where the float program's input has a
    symbolic size, so the int8 .pt2 takes the batch sizes the float one took; None when all are static."""
    import torch

    if program is None or kwargs:
        return None
    inputs = [spec for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    shapes: list[Any] = []
    dynamic = False
    for spec, arg in zip(inputs, args):
        node = placeholders.get(getattr(spec.arg, "name", ""))
        value = None if node is None else node.meta.get("val")
        if not isinstance(arg, torch.Tensor) or not isinstance(value, torch.Tensor):
            shapes.append(None)
            continue
        dims = {i: torch.export.Dim.AUTO for i, size in enumerate(value.shape) if not isinstance(size, int)}
        dynamic = dynamic or bool(dims)
        shapes.append(dims or None)
    return tuple(shapes) if dynamic and len(shapes) == len(args) else None


def quantize_command(argv: list[str]) -> int:
    """``QuantPlan.quantize`` from the command line: rewrites, equalization, mapping, calibration,
    convert and bias correction, exactly as verify applies them; the result saved as TorchScript.
    An exported graph (a .pt2) is quantized with the pt2e flow, as verify measures it, and saved
    as a .pt2."""
    args = _quantize_parser().parse_args(argv)
    out = Path(args.output)
    if out.suffix not in (".pt", ".pt2"):
        raise ConfigError(
            f"--output must end in .pt (TorchScript) or, for a .pt2 model, .pt2 (torch.export), got {out.name}"
        )
    check_outputs(
        [("--output", args.output)],
        [args.model, args.weights, args.plan, args.calibration, args.eval_data],
    )
    from qlint.advice.verify_session import batch_list
    from qlint.core.load import load_batches
    from qlint.core.ops import is_aten_graph
    from qlint.core.sqnr import sqnr_text
    from qlint.measure.fallback import weighted_coverage

    with user_output_to_stderr():
        loaded, plan = load_model_and_plan(args)
        exported = is_aten_graph(loaded.module)
        if exported != (out.suffix == ".pt2"):
            raise ConfigError(
                f"--output {out.name}: an exported (aten) model such as a .pt2 is quantized with the pt2e flow "
                "and saved as .pt2 (torch.export); any other model as .pt (TorchScript)"
            )
        calibration = batch_list(load_batches(args.calibration), "calibration")
        eval_data = batch_list(load_batches(args.eval_data), "eval") if args.eval_data else []
        notes: list[str] = []
        if exported:
            from qlint.advice.verify_pt2e import build_pt2e
            from qlint.measure.pt2e_trial import pt2e_float_layers

            converted, notes = build_pt2e(loaded.module, plan, calibration)
            _floats, int8, total = pt2e_float_layers(converted, None)
        else:
            converted = plan.quantize(loaded.module, calibration)
            int8, total, _ = weighted_coverage(converted)
        sqnr = _output_sqnr(loaded.module, converted, eval_data) if eval_data else None
        if exported:
            _save_exported(converted, calibration[0], loaded.exported_program, out)
            how = (
                "torch.export of the pt2e flow's model (prepare_pt2e, convert_pt2e); "
                f"torch.export.load reads it after {PT2E_LOAD_IMPORT}"
            )
        else:
            how = "TorchScript, " + _save_int8(converted, calibration[0], out)
    if total and not int8:  # an exact output SQNR then says only that nothing was quantized
        notes.append(
            f"none of the model's {total} conv/linear/recurrent/attention ops runs in int8: the saved model "
            "computes them in float (qlint MODEL says why: QL106)"
        )
    for note in notes:
        print(printable(f"note: {note}"), file=sys.stderr)
    measured = "" if sqnr is None else f"; output SQNR {sqnr_text(sqnr, 2)} on {len(eval_data)} eval batches"
    write_stdout(f"wrote {printable(out)} ({how}; int8 {int8}/{total} conv/linear/recurrent/attention ops{measured})\n")
    return 0


__all__ = ["quantize_command"]

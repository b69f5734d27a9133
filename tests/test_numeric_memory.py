"""compare() streams: peak memory does not grow with the number of batches."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter so that the peak RSS is this workload's alone.  The 10-batch
# run goes first; the 100-batch run can only raise the process peak if it holds more.
SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, tracemalloc, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, sys.argv[1])
    import torch
    from torch import nn
    torch.set_num_threads(1)  # shared cores: avoid oversubscription stalls
    from qlint.numeric.compare import compare
    from qlint.numeric.examples import quantize_fx_ptq

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1),
    ).eval()
    shape = (8, 3, 32, 32)
    _, quantized = quantize_fx_ptq(model, [torch.randn(shape) for _ in range(2)])

    def batches(count):
        generator = torch.Generator().manual_seed(1)
        for _ in range(count):
            yield torch.randn(shape, generator=generator)

    # what one batch's float activations weigh: the growth per batch if they were kept
    activations = []
    hooks = [m.register_forward_hook(lambda m, a, o: activations.append(o.numel() * 4)) for m in model]
    with torch.no_grad():
        model(torch.randn(shape))
    for hook in hooks:
        hook.remove()

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

    result = {"activation_mib_per_batch": sum(activations) / 2**20}
    for count in (10, 100):
        tracemalloc.start()
        report = compare(model, quantized, batches(count))
        result[f"python_peak_mib_{count}"] = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        result[f"rss_peak_mib_{count}"] = peak_mib()
        result[f"layers_{count}"] = len(report.layers)
        result[f"elements_{count}"] = report.layers[0].extra["propagated"]["elements"]
    print(json.dumps(result))
    """
)


def test_peak_memory_does_not_grow_with_batch_count():
    completed = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    # the runs really streamed 10 and 100 batches through every layer
    assert result["layers_100"] == result["layers_10"] >= 4
    assert result["elements_100"] == 10 * result["elements_10"]
    growth_allowed = 30.0
    # keeping the activations of 90 extra batches would cost far more than the allowance
    assert 90 * result["activation_mib_per_batch"] > 5 * growth_allowed
    assert result["rss_peak_mib_100"] - result["rss_peak_mib_10"] < growth_allowed, result
    assert result["python_peak_mib_100"] < result["python_peak_mib_10"] + 1.0, result

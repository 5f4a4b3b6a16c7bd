from __future__ import annotations

import os

import pytest

# The suite tests the CPU engine (its C kernels, quantized weights) wherever it runs: "auto"
# means the CPU here even on a machine with a GPU. tests/test_device.py names its devices, and
# scripts/gpu_check.sh checks the GPU. Server subprocesses inherit this.
os.environ.setdefault("FERRY_DEVICE", "cpu")

LONG_TEXT = (
    "The ferry left the harbour at dawn, its engines humming as gulls circled overhead. "
    "Passengers gathered on the deck to watch the coastline fade into a pale blue haze. "
    "A child pointed at a pod of dolphins racing alongside the hull, and her father lifted her "
    "so she could see them leap. In the galley, the cook was frying eggs and toasting thick slices "
    "of bread, and the smell drifted up the narrow stairs. The captain checked the charts once more: "
    "the crossing would take four hours if the wind held, longer if the storm to the south moved north. "
    "Mathematics offers another kind of voyage. A prime number has exactly two divisors, one and itself; "
    "the first few are two, three, five, seven, eleven and thirteen. Euclid proved that there are "
    "infinitely many of them by supposing a largest one and building a number that no listed prime divides. "
    "In computing, a scheduler decides which task runs next. Operating systems use queues, priorities and "
    "time slices, while inference engines batch requests so that one pass over the weights serves many users. "
    "Recipes, too, are schedules: boil the water, add the pasta, stir, and drain it while it is still firm. "
    "Gardeners plan their seasons the same way, sowing peas in early spring, tomatoes after the last frost, "
    "and garlic in the cool weeks of autumn so that it can root before winter. The history of bridges is a "
    "history of materials: timber, then stone arches, then iron, steel cables and reinforced concrete. "
    "Each new material allowed longer spans and bolder shapes, and each failure taught engineers something "
    "about wind, load and fatigue that no calculation had predicted. On the ferry, the storm never came."
)


@pytest.fixture(scope="session")
def embedded_dir():
    from ferry.model.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def llm():
    from ferry import LLM

    return LLM()


@pytest.fixture(scope="session")
def exact_llm():
    """The embedded model with exact products (float32 activations): the dequantized model's results,
    the same tokens however requests are batched; what parity and invariance tests hold the engine to."""
    from ferry import LLM

    return LLM(quant_activations="exact")


@pytest.fixture(scope="session")
def parity_prompts(exact_llm):
    """8 prompts of different lengths, 5 to 400 tokens, cut from one natural text at different places."""
    ids = exact_llm.tokenizer.encode(LONG_TEXT * 2, add_special_tokens=False)
    lengths = [5, 17, 42, 90, 150, 230, 310, 400]
    offsets = [0, 11, 40, 7, 63, 120, 25, 3]
    return [ids[o:o + n] for o, n in zip(offsets, lengths)]

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite tests the CPU engine (its C kernels, quantized weights) wherever it runs: "auto"
# means the CPU here even on a machine with a GPU. tests/test_device.py names its devices, and
# scripts/gpu_check.sh checks the GPU. Server subprocesses inherit this.
os.environ.setdefault("FERRY_DEVICE", "cpu")

# The slow tiers, left out by `make test-fast` (-m "not (browser or distributed or kernel_build or
# server or model)") and run by `make test`. Each lists test files, or single tests as "FILE::NAME"
# (measured with --durations: every test listed takes seconds, the rest of the suite under one); a new
# test file that starts a server, a browser, Ray or rank processes, a C build, or generates with a
# model for seconds adds one line here.
TIERS: dict[str, tuple[str, ...]] = {
    # headless Chromium driven by selenium
    "browser": ("test_dashboard.py", "test_chat_page.py", "test_data_parallel.py"),
    # Ray replicas, tensor-parallel rank processes
    "distributed": ("test_data_parallel.py", "test_tensor_parallel.py",
                    "test_kv_cache_dtypes.py::test_tensor_parallel_ranks_hold_their_shards_in_a_smaller_dtype",
                    "test_moe.py::test_experts_split_over_two_ranks_match_one_process"),
    # tests that run the C compiler themselves (another target, or to read the assembly)
    "kernel_build": ("test_kernel_prefetch.py",
                     "test_quant.py::test_kernels_built_for_avx2_only_give_the_same_products"),
    # the HTTP server: a `ferry serve` subprocess (tests/test_server.py's server(),
    # test_server_hardening.py's logged_server()), or the app on a thread (serve_in_thread)
    "server": ("test_server_image_families.py", "test_server_mmproj.py",
               "test_server.py", "test_server_hardening.py", "test_server_robustness.py",
               "test_server_structured.py", "test_server_grammar_hardening.py",
               "test_server_responses_hardening.py", "test_server_templates_tools.py",
               "test_tool_call_recovery.py", "test_dashboard.py", "test_chat_page.py",
               "test_data_parallel.py", "test_tensor_parallel.py",
               "test_server_tools.py", "test_server_embeddings.py", "test_agent_loop.py", "test_models_dir.py",
               "test_tool_parser_qwen_xml.py::test_chat_route_reads_the_xml_calls_whole_and_streamed",
               "test_tool_parser_qwen_xml.py::test_chat_route_takes_a_required_call_with_this_parser"),
    # seconds of generation with a real model (the embedded SmolLM2, tiny transformers models): parity
    # and invariance sweeps, and the ferry commands run as a subprocess
    "model": ("test_gemma3_gguf.py", "test_smolvlm_gguf.py", "test_qwen3_vl_gguf.py",
              "test_architectures.py", "test_batching_invariance.py", "test_hf_parity.py", "test_kv_cache_dtypes.py",
              "test_spec_decode.py", "test_structured.py", "test_toy_architecture.py", "test_hybrid_llama_cpp.py",
              "test_bench.py::test_bench_offline_and_online_write_json_and_plots",
              "test_bench.py::test_bench_sweep_marks_the_best_configuration_within_the_slo",
              "test_bench.py::test_bench_input_errors_are_messages",
              "test_bench.py::test_bench_kernels_times_every_implementation_against_its_bound",
              "test_bench.py::test_bench_kernels_holds_q8_products_to_the_int8_peak",
              "test_bench.py::test_bench_accuracy_compares_next_token_predictions",
              "test_cli.py::test_generate_prints_the_completion",
              "test_device.py::test_engine_on_device_matches_transformers_and_any_batching",
              "test_isolation.py::test_a_poisoned_request_fails_alone_and_the_others_finish_as_in_a_clean_run",
              "test_cli.py::test_chat_streams_a_reply_and_exits_on_eof",
              "test_cli.py::test_the_core_install_generates_and_names_the_extra_a_command_needs",
              "test_cli.py::test_the_batching_report_commands_are_named_for_what_they_report",
              "test_model_names.py::test_the_cli_generates_with_a_model_name",
              "test_model_names.py::test_a_safetensors_repository_by_name_generates_what_its_directory_does",
              "test_model_names.py::test_a_quant_tag_picks_that_gguf_and_generates_what_the_file_does",
              "test_prefix_caching.py::test_cached_prefixes_give_the_same_tokens_on_the_model",
              "test_quant.py::test_a_mixed_file_generates_as_its_dequantized_copy",
              "test_quant.py::test_quantized_and_float_engines_agree",
              "test_quant.py::test_embedded_model_stays_quantized_and_equals_its_float_conversion",
              "test_quant.py::test_a_q8_engine_stays_close_to_the_exact_one",
              "test_quant_packed.py::test_a_q8_model_packs_its_q4_layers_and_generates_as_unpacked",
              "test_kernels_boundary.py::test_ferry_no_kernels_runs_the_torch_path_with_the_kernels_results",
              "test_sampling.py::test_seed_reproduces_and_different_seeds_differ",
              "test_sim.py::test_simulate_command_never_imports_torch",
              "test_sim.py::test_simulate_batching_report",
              "test_sim.py::test_tune_picks_the_best_configuration_within_the_slo",
              "test_sim.py::test_measure_steps_times_real_steps_on_the_model_executor"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tiers its file (or the test itself) is listed under in TIERS."""
    for item in items:
        file = Path(str(item.fspath)).name
        test = f"{file}::{getattr(item, 'originalname', item.name)}"
        for tier, entries in TIERS.items():
            if file in entries or test in entries:
                item.add_marker(getattr(pytest.mark, tier))


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

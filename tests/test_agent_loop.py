"""An agent framework's real loop against the server: the OpenAI Agents SDK runs a task with two
tools offered to the end (a grammar-constrained call, its result back, then a final answer)."""
from __future__ import annotations

import pytest

from tests.test_server import MODEL, serve_in_thread



@pytest.fixture(scope="module")
def url(llm):
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine
    from ferry.server.app import build_app

    engine = AsyncEngine(LLMEngine.from_config(llm.config, llm.engine.executor))
    with serve_in_thread(build_app(engine, MODEL)) as u:
        yield u


def test_the_agents_sdk_loop_calls_a_tool_and_answers(url):
    from openai import AsyncOpenAI

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    ran: list[tuple[str, object]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        # The task's last step is the answer: the loop's next request says tool_choice "none".
        agent.model_settings = agent.model_settings.resolve(ModelSettings(tool_choice="none"))
        return f"18 degrees and sunny in {city}"

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append(("add", (a, b)))
        agent.model_settings = agent.model_settings.resolve(ModelSettings(tool_choice="none"))
        return a + b

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=url + "/v1", api_key="none",
                                                                              max_retries=0))
    # The first turn must call a tool (the grammar makes the call valid); the tool then asks for the
    # answer (the tiny model would call again under auto), which the model gives with the result in its prompt.
    agent = Agent(name="weather", instructions="Answer with the tools' results.", tools=[get_weather, add],
                  model=model, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40,
                                                            parallel_tool_calls=False),
                  reset_tool_choice=False)  # the SDK would reset the tools' "none" to auto
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(ran) == 1 and ran[0][0] in ("get_weather", "add")  # the tool ran with arguments that parsed
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"

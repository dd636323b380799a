"""The council of `kmesh bench council`: AutoGen AgentChat's RoundRobinGroupChat, unmodified, run
by the client venv's Python (`make clients`), not by KMesh's: it imports AutoGen and nothing of
KMesh.

    python client.py SPEC.json

SPEC: base_url, model, agents, max_tokens, task, extra_body (the one default extra body the
client is given; KMesh's `cache_salt` for instance). Each agent is an AssistantAgent with its own
system message; one round is one turn of every agent (`max_turns`). After each round it prints
one JSON line, {"round": r, "messages": [{"source", "content"}]}, and reads one line from stdin
before the next round (the driver reads the server's counters in between). Temperature 0.
"""

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_core.models import ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

# (who, what they weigh): each agent's own system message.
PERSONAS = (
    ("an economist", "who weighs costs and prices"),
    ("an engineer", "who checks whether things can be built"),
    ("a historian", "who recalls what was tried before"),
    ("a farmer", "who speaks for the fields and the harvest"),
    ("a doctor", "who thinks of the people's health"),
    ("a judge", "who looks for what is fair"),
    ("a merchant", "who knows the roads and the markets"),
    ("a teacher", "who asks what the children will inherit"),
)


async def council(spec: dict[str, Any]) -> None:
    client = OpenAIChatCompletionClient(
        model=spec["model"],
        base_url=spec["base_url"],
        api_key="unused",
        model_info=ModelInfo(
            vision=False,
            function_calling=False,
            json_output=False,
            family="unknown",
            structured_output=False,
        ),
        temperature=0,
        max_tokens=spec["max_tokens"],
        extra_body=spec["extra_body"],
    )
    agents = []
    for i in range(spec["agents"]):
        who, what = PERSONAS[i % len(PERSONAS)]
        system = (
            f"You are {who} {what}, and you sit on the town council. Speak only as {who}: "
            f"begin your answer with 'As {who},'."
        )
        agents.append(AssistantAgent(f"member_{i}", model_client=client, system_message=system))
    team = RoundRobinGroupChat(agents, max_turns=spec["agents"])
    for round_index in range(spec["rounds"]):
        result = await team.run(task=spec["task"] if round_index == 0 else None)
        messages = [
            {"source": m.source, "content": m.to_model_text()}
            for m in result.messages
            if m.source != "user"
        ]
        print(json.dumps({"round": round_index, "messages": messages}), flush=True)
        sys.stdin.readline()
    await client.close()


if __name__ == "__main__":
    asyncio.run(council(json.loads(Path(sys.argv[1]).read_text())))

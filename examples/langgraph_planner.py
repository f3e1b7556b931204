#!/usr/bin/env python3
"""A LangGraph agent that uses the aip broker as its tool runtime (the pattern of seed 003).

The agent's reasoning runs here; its tools run on a device connected to the broker. The agent
drives one task over REST:

  1. POST /api/tasks with "driver": true       the broker picks the device and opens the task;
  2. POST /api/tasks/{id}/commands list_tools  the device's tools (MCPToolInfo) become the
                                               model's function tools;
  3. a LangGraph graph: call_model -> tools -> call_model ... where the tools node sends each
     tool call to the device with POST /api/tasks/{id}/commands and waits for its Result;
  4. POST /api/tasks/{id}/complete             the model's final answer is the task's result.

The model is any OpenAI-compatible chat-completions endpoint (OPENAI_BASE_URL, OPENAI_API_KEY,
--model). Against the default `aip dev`:

    aip dev &
    aip device --id demo-pc --capability demo &
    OPENAI_BASE_URL=http://127.0.0.1:11434/v1 OPENAI_API_KEY=ollama \\
        python3 examples/langgraph_planner.py --capability demo --model llama3.1 "say hi"

Needs: pip install langgraph langchain-openai   (see scripts/python-requirements.txt)
"""

import argparse
import json
import os
import sys
import urllib.request

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph


class Broker:
    """The broker's REST API, for one driven task."""

    def __init__(self, rest, api_key):
        self.rest = rest.rstrip("/")
        self.api_key = api_key

    def post(self, path, body):
        request = urllib.request.Request(
            f"{self.rest}{path}", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", **({"X-API-Key": self.api_key} if self.api_key else {})})
        try:
            with urllib.request.urlopen(request, timeout=660) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise SystemExit(f"{path}: HTTP {error.code}: {error.read().decode()}")

    def run(self, task_id, tool_name, tool_type, arguments, call_id=None):
        """Runs one Command on the task's device and returns its Result."""
        action = {"tool_name": tool_name, "tool_type": tool_type, "parameters": arguments}
        if call_id:
            action["call_id"] = call_id
        return self.post(f"/api/tasks/{task_id}/commands", {"actions": [action]})["results"][0]


def build_graph(model, broker, task_id, tools):
    """call_model -> tools -> call_model ... -> END, the tools running on the device."""
    by_name = {t["tool_name"]: t for t in tools}

    def call_model(state):
        return {"messages": [model.invoke(state["messages"])]}

    def run_tools(state):
        answers = []
        for call in state["messages"][-1].tool_calls:
            tool = by_name.get(call["name"])
            if tool is None:
                content = json.dumps({"status": "failure", "error": f"unknown tool {call['name']}"})
            else:
                result = broker.run(task_id, tool["tool_name"], tool.get("tool_type", "action"),
                                    call["args"], call["id"])
                content = json.dumps({k: result.get(k) for k in ("status", "result", "error")})
            answers.append(ToolMessage(content=content, tool_call_id=call["id"]))
        return {"messages": answers}

    def route(state):
        return "tools" if state["messages"][-1].tool_calls else END

    graph = StateGraph(MessagesState)
    graph.add_node("call_model", call_model)
    graph.add_node("tools", run_tools)
    graph.add_edge(START, "call_model")
    graph.add_conditional_edges("call_model", route, ["tools", END])
    graph.add_edge("tools", "call_model")
    return graph.compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("request", help="what the task is to achieve, in words")
    parser.add_argument("--rest", default=os.environ.get("AIP_REST", "http://127.0.0.1:5000"))
    parser.add_argument("--api-key", default=os.environ.get("AIP_API_KEY"))
    placement = parser.add_mutually_exclusive_group(required=True)
    placement.add_argument("--target", help="run on this device")
    placement.add_argument("--capability", help="run on an available device with this capability")
    parser.add_argument("--model", default=os.environ.get("AIP_LLM_MODEL", "gpt-4o-mini"))
    parser.add_argument("--max-steps", type=int, default=20, help="model calls at most")
    args = parser.parse_args()

    broker = Broker(args.rest, args.api_key)
    task = {"version": 1, "description": args.request, "originating_agent_id": "langgraph-planner",
            "driver": True}
    if args.target:
        task["target_id"] = args.target
    else:
        task["required_capabilities"] = [args.capability]
    task_id = broker.post("/api/tasks", task)["task_id"]
    print(f"task {task_id} opened", flush=True)

    try:
        listing = broker.run(task_id, "list_tools", "action", {"tool_type": "action"})
        tools = listing.get("result") or []
        functions = [{"type": "function", "function": {
            "name": t["tool_name"], "description": t.get("description") or "",
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}} for t in tools]
        model = ChatOpenAI(model=args.model).bind_tools(functions)
        graph = build_graph(model, broker, task_id, tools)
        final = graph.invoke(
            {"messages": [SystemMessage("You carry out the user's task by calling the device's tools. "
                                        "When it is done, answer with the outcome."),
                          HumanMessage(args.request)]},
            {"recursion_limit": 2 * args.max_steps + 1})
        answer = final["messages"][-1].content
    except BaseException as error:  # the task must not stay open: fail it with the reason
        broker.post(f"/api/tasks/{task_id}/complete", {"error": f"the LangGraph agent failed: {error}"})
        raise
    ended = broker.post(f"/api/tasks/{task_id}/complete", {"result": answer})
    print(f"task {task_id} {ended['state']}: {answer}", flush=True)
    return 0 if ended["state"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())

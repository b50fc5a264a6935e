"""The agent examples (examples/search_r1, examples/retool): the retool sandbox's limits and escapes, the search
server and tool over real loopback HTTP, the rewards, the inline SFT layout, and one end-to-end run of each."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples.retool import reward as retool_reward
from examples.retool.python_tool import python
from examples.retool.sandbox import SandboxLimits, network_isolation, run_code
from examples.search_r1 import search_tool
from examples.search_r1.retrieval_server import BM25Index, make_server
from examples.search_r1.reward import answer_reward
from slime.rollout.tools import load_tools, run_tool_call
from slime.utils.tool_parsers import ToolCall

REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_mb=512, file_size_mb=1, max_output_chars=500)


# ---------------------------------------------------------------- retool sandbox
def run_timed(code: str):
    started = time.monotonic()
    result = run_code(code, LIMITS)
    return result, time.monotonic() - started


def test_sandbox_runs_code_and_returns_its_output():
    result, _ = run_timed("print(37 * 48 + 19)")
    assert result.ok and result.output == "1795\n"


def test_sandbox_stops_a_busy_loop_at_its_cpu_time_limit():
    limits = SandboxLimits(wall_seconds=15.0, cpu_seconds=1)  # a wall limit far off, even on a loaded machine
    started = time.monotonic()
    result = run_code("while True:\n    pass", limits)
    assert "used more than 1 s of CPU time and was stopped" in result.output and not result.ok
    assert time.monotonic() - started < limits.wall_seconds


def test_sandbox_stops_a_sleeping_process_at_its_wall_clock_limit():
    result, seconds = run_timed("import time\ntime.sleep(60)")
    assert "ran past the 2 s time limit and was stopped" in result.output and result.timed_out
    assert seconds < LIMITS.wall_seconds + 3


def test_sandbox_memory_limit_turns_10gb_into_an_error():
    result, seconds = run_timed("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert "MemoryError" in result.output and "512 MB" in result.output and "allocated" not in result.output
    assert seconds < 5


@pytest.mark.parametrize("code", [
    "import socket\nsocket.socket().connect(('127.0.0.1', 80))",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1')",
    "import _socket\n_socket.socket()",
])
def test_sandbox_has_no_network(code):
    result, seconds = run_timed(code)
    assert not result.ok and "sandbox: importing" in result.output and "is disabled" in result.output
    assert seconds < 5


def test_sandbox_network_namespace_has_only_a_loopback_interface():
    prefix, _ = network_isolation()
    if not prefix:
        pytest.skip("no network namespace on this machine (not root, no user namespaces)")
    result, _ = run_timed("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in result.output.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


@pytest.mark.parametrize("target", ["/tmp/retool-escape-{n}.txt", str(REPO / "retool-escape-{n}.txt")])
def test_sandbox_refuses_writes_outside_its_scratch_directory(target):
    path = Path(target.format(n=time.monotonic_ns()))
    for code in (f"open({str(path)!r}, 'w').write('x')",
                 f"import os\nos.close(os.open({str(path)!r}, os.O_CREAT | os.O_WRONLY))",
                 f"import os\nos.symlink({str(path)!r}, 'link')\nopen('link', 'w').write('x')"):
        result, seconds = run_timed(code)
        assert "writing outside the scratch directory is not allowed" in result.output, result.output
        assert not path.exists() and seconds < 5
    result, _ = run_timed(f"import os\nos.remove({str(REPO / 'README.md')!r})")
    assert "os.remove outside the scratch directory" in result.output and (REPO / "README.md").exists()


def test_sandbox_scratch_directory_is_writable_and_removed_afterwards():
    result, _ = run_timed("import os\nopen('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read(), "
                          "os.getcwd())")
    text, scratch = result.output.split()
    assert result.ok and text == "kept" and not Path(scratch).exists()


@pytest.mark.parametrize("code", ["import os\nos.fork()", "import subprocess\nsubprocess.run(['true'])",
                                  "import os\nos.system('true')", "import ctypes"])
def test_sandbox_refuses_new_processes_and_native_calls(code):
    result, _ = run_timed(code)
    assert not result.ok and "sandbox:" in result.output and "disabled" in result.output


def test_sandbox_caps_output():
    result, seconds = run_timed("print('x' * 10**6)")
    assert len(result.output) < LIMITS.max_output_chars + 100
    assert "[output cut to its first and last 250 characters]" in result.output
    flood, seconds = run_timed("while True:\n    print('y' * 1000)")  # stopped by the 1 MB file-size limit
    assert "[output cut" in flood.output and seconds < LIMITS.wall_seconds + 3


def test_sandbox_traceback_shows_the_codes_frames_only():
    result, _ = run_timed("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError" in result.output and 'File "main.py", line 2, in f' in result.output
    assert "sandbox_child" not in result.output


def test_python_tool_through_the_tool_runner():
    tools = load_tools(("examples.retool.python_tool.python",))
    call = ToolCall("python", {"code": "print(sum(range(10)))"}, "")
    result = asyncio.run(run_tool_call(call, tools, timeout_s=20))
    assert result.error is None and result.text == "45\n"
    assert python("x = 1") == "(no output: print() the values you want to see)"


# ---------------------------------------------------------------- search server and tool
FACTS = ["The capital of Zorvia is Plim.", "The capital of Quenland is Tarv.", "The main river of Zorvia is the Ash.",
         "The main river of Quenland is the Elm."]


@pytest.fixture(scope="module")
def search_url():
    server = make_server(BM25Index(FACTS), port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()
    server.server_close()


def post(url: str, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_bm25_index_ranks_the_matching_fact_first():
    hits = BM25Index(FACTS).search("capital of Quenland", 2)
    assert hits[0][0] == "The capital of Quenland is Tarv." and hits[0][1] > hits[1][1] > 0
    assert BM25Index(FACTS).search("the of", 2) == []  # stopwords only


def test_search_tool_gets_the_right_document_over_http(search_url, monkeypatch):
    monkeypatch.setenv(search_tool.URL_ENV, search_url)
    text = asyncio.run(search_tool.search("capital of Zorvia"))
    assert text.splitlines()[0] == "Doc 1: The capital of Zorvia is Plim."
    assert len(text.splitlines()) == search_tool.TOPK


def test_search_server_rejects_malformed_requests(search_url):
    assert post(search_url, b"not json")[0] == 400
    status, payload = post(search_url, json.dumps({"queries": "capital"}).encode())
    assert status == 400 and "queries" in payload["error"]
    status, payload = post(search_url, json.dumps({"queries": ["x"], "topk": 0}).encode())
    assert status == 400 and "topk" in payload["error"]


def test_search_tool_reports_a_server_that_is_down(monkeypatch):
    from slime.utils.misc import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}/retrieve"
    monkeypatch.setenv(search_tool.URL_ENV, url)
    text = asyncio.run(search_tool.search("capital of Zorvia"))
    assert text.startswith(f"Error: the retrieval server at {url} is unreachable")


def test_search_tool_is_cut_off_by_the_tool_timeout_when_the_server_hangs(monkeypatch):
    listener = socket.socket()  # accepts connections (backlog) and never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        monkeypatch.setenv(search_tool.URL_ENV, f"http://127.0.0.1:{listener.getsockname()[1]}/retrieve")
        tools = load_tools(("examples.search_r1.search_tool.search",))
        started = time.monotonic()
        result = asyncio.run(run_tool_call(ToolCall("search", {"query": "x"}, ""), tools, timeout_s=0.5))
        assert result.error is not None and "--tool-timeout" in result.text
        assert time.monotonic() - started < 3
    finally:
        listener.close()


# ---------------------------------------------------------------- rewards and the inline SFT layout
def test_search_reward_reads_the_final_answer_only():
    info = "\n\n<information>Doc 1: The capital of Zorvia is <answer>Plim</answer>.</information>\n\n"
    assert answer_reward(f"<search>capital of Zorvia</search>{info}<answer> plim </answer>", "Plim") == 1.0
    assert answer_reward(f"<search>capital of Zorvia</search>{info}<answer>Tarv</answer>", "Plim") == 0.0
    assert answer_reward(f"<search>capital of Zorvia</search>{info}", "Plim") == 0.0


def test_retool_reward_ignores_a_boxed_answer_printed_by_the_code():
    response = ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call><|im_end|>\n'
                "<|im_start|>tool\n\\boxed{1795}\n<|im_end|>\n<|im_start|>assistant\n")
    sample = type("S", (), {"label": "1795"})
    sample.response = response + "\\boxed{1795}<|im_end|>"
    assert asyncio.run(retool_reward.boxed_answer(None, sample)) == 1.0
    sample.response = response + "no answer<|im_end|>"
    assert asyncio.run(retool_reward.boxed_answer(None, sample)) == 0.0


def test_inline_sft_masks_the_information_text_only(tmp_path):
    from transformers import AutoTokenizer

    from examples.search_r1.inline_sft_rollout import build_segmented_sample
    from examples.search_r1.task import build_task
    from slime.rollout.dataset import render_chat_prompt
    from slime.utils.types import Sample

    paths = build_task(tmp_path, seed=0, num_countries=8, tool_share=1.0)  # every SFT row searches
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    row = json.loads(paths["sft"].read_text().splitlines()[0])
    assert "tools" not in row  # xml_tags: the GRPO prompt has no template tool block, so neither has SFT
    sample = build_segmented_sample(tokenizer, Sample(prompt=row["prompt"], metadata=dict(row["metadata"])))
    prompt = render_chat_prompt(tokenizer, row["prompt"])
    assert tokenizer.decode(sample.tokens[:sample.prompt_length]) == prompt
    response = sample.tokens[sample.prompt_length:]
    masked = tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if m == 0])
    trained = tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if m == 1])
    segments = row["metadata"]["segments"]
    assert masked == segments[1][0] and masked.strip().startswith("<information>")
    assert trained == segments[0][0] + segments[2][0]


# ---------------------------------------------------------------- end to end
def run_example(script: str, out_dir: Path, num_sft_rollouts: int) -> dict:
    command = [sys.executable, str(REPO / "examples" / script), "--out-dir", str(out_dir),
               "--sft-rollouts", str(num_sft_rollouts), "--num-rollout", "2"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def grpo_rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "grpo_run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.e2e
@pytest.mark.parametrize("script, num_sft_rollouts", [
    ("search_r1/run.py", 12),
    pytest.param("retool/run.py", 16, marks=pytest.mark.slow),  # its sandbox has fast tests above
])
def test_example_runs_multi_turn_tool_use_end_to_end(script, num_sft_rollouts, tmp_path):
    summary = run_example(script, tmp_path, num_sft_rollouts)
    rows = grpo_rows(tmp_path)
    assert [row["rollout_id"] for row in rows] == [0, 1]
    for row in rows:
        assert row["rollout/turns_per_sample"] > 1 and row["rollout/tool_calls_per_sample"] > 0, row
        # some calls reach the tool and come back with its answer (errors: malformed calls)
        assert row["rollout/tool_errors_per_sample"] < row["rollout/tool_calls_per_sample"], row
    assert summary["turns_per_sample"] > 1 and summary["tool_calls_per_sample"] > 0
    assert summary["run_dir"] == str(tmp_path)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("script", ["retool/run.py", "search_r1/run.py"])
def test_example_reward_rises_with_rl(script, tmp_path):
    """The example's own CPU command (its defaults): the warm start leaves the model guessing about half the time,
    and RL teaches it to use the tool, so the reward of the last rollouts is clearly above rollout 0's."""
    result = subprocess.run([sys.executable, str(REPO / "examples" / script), "--out-dir", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"STDOUT:\n{result.stdout[-4000:]}\nSTDERR:\n{result.stderr[-6000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(summary)
    assert summary["reward_after_rl"] > summary["reward_before_rl"] + 0.1

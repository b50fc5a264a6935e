"""The Search-R1 example's task, built locally: made-up countries whose capitals only the corpus knows, SFT
trajectories that search for them, GRPO prompts, a BPE tokenizer trained on all of it, and a tiny Qwen3 model.
Nothing is downloaded.

A share `tool_share` of the SFT trajectories search and answer with what the documents say; the others answer at
once with a made-up name (one of `num_decoys` towns that are no country's capital: the model cannot know these
countries, so a guess is never right). After that warm start the model searches in about that share of its answers
and guesses in the others: RL has something to learn (search every time), and the reward before RL is well below
what it can reach. A guess that could name a capital would be right now and then, and RL can then teach the model
to answer the few countries from memory without searching (it did, one run in two, when the guesses were drawn
from the capitals too). The countries are few (`num_countries`, 4 by default), and the GRPO prompts are the SFT's:
the query must copy the country out of the question (a name 25 tokens back), which a 4-layer model learns in 120-160
SFT steps out of 4 countries (for all four or for two or three of them, depending on the seed: README) and not in 80
out of 8 (it stays at chance, one right query in 8; copying the capital out of the documents it learns either way).

Files written under `out_dir`: corpus.jsonl (two facts per country, for the retrieval server), sft.jsonl (prompt +
`metadata.segments` for `inline_sft_rollout`), train.jsonl (prompt + label) and model/ (HF checkpoint).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from examples.search_r1.retrieval_server import BM25Index
from examples.search_r1.search_tool import TOPK, format_documents, search
from slime.rollout.multi_turn import DEFAULT_INLINE_TEMPLATE
from slime.rollout.tools import tool_schema
from slime.utils.tiny_model import build_tiny_model

MODEL_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
INSTRUCTION = "Search with <search>query</search>, then answer with <answer>name</answer>."
SYLLABLES = ["zor", "vi", "quen", "tar", "plim", "mo", "ka", "ril", "sen", "do", "bra", "lu", "fen", "ti", "gar",
             "nes", "ou", "pra", "mel", "za"]
RIVERS = ["Ash", "Brook", "Cold", "Deep", "Elm", "Fern", "Gold", "Hollow"]


def made_up_names(rng: random.Random, count: int, num_syllables: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(num_syllables)).capitalize())
    return sorted(names)


def question(country: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the capital of {country}? {INSTRUCTION}"}]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_task(out_dir: str | Path, seed: int = 0, num_countries: int = 4, tool_share: float = 0.5,
               num_sft_rows: int = 256, num_decoys: int = 12) -> dict[str, Path]:
    if not 0 < tool_share <= 1:
        raise ValueError(f"tool_share must be in (0, 1], got {tool_share}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = made_up_names(rng, 2 * num_countries + num_decoys, 3)
    rng.shuffle(names)
    countries, capitals, decoys = (sorted(names[:num_countries]), names[num_countries:2 * num_countries],
                                   names[2 * num_countries:])
    facts = [f"The capital of {country} is {capital}." for country, capital in zip(countries, capitals)]
    facts += [f"The main river of {country} is the {rng.choice(RIVERS)} River." for country in countries]
    index = BM25Index(facts)
    schema = tool_schema(search)  # in the tokenizer's corpus; xml_tags offers no tool block (the question says how)

    def trajectory(country: str, capital: str) -> list[list]:
        if rng.random() >= tool_share:
            return [[f"<answer>{rng.choice(decoys)}</answer><|im_end|>", True]]
        query = f"capital of {country}"
        documents = format_documents([text for text, _ in index.search(query, TOPK)])
        return [[f"<search>{query}</search>", True],
                [DEFAULT_INLINE_TEMPLATE.format(result=documents), False],
                [f"<answer>{capital}</answer><|im_end|>", True]]

    sft_countries = [rng.randrange(num_countries) for _ in range(num_sft_rows)]
    sft_rows = [{"prompt": question(countries[i]), "metadata": {"segments": trajectory(countries[i], capitals[i])}}
                for i in sft_countries]
    train_rows = [{"prompt": question(country), "label": capital} for country, capital in zip(countries, capitals)] * 4

    paths = {name: out_dir / f"{name}.jsonl" for name in ("corpus", "sft", "train")}
    write_jsonl(paths["corpus"], [{"contents": fact} for fact in facts])
    write_jsonl(paths["sft"], sft_rows)
    write_jsonl(paths["train"], train_rows)

    # Everything the model reads or writes is in the tokenizer's corpus (the tool block the chat template renders
    # included), so tags, names and the tool schema cost few tokens each.
    tool_block = json.dumps(schema) + \
        ' Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    trajectories = ["".join(text for text, _ in row["metadata"]["segments"]) for row in sft_rows]
    corpus = [question(c)[0]["content"] for c in countries] * 3 + trajectories * 3 + facts + decoys * 3 + \
        ["user assistant system # Tools", tool_block] * 20
    paths["model"] = build_tiny_model(out_dir / "model", arch="qwen3", corpus=corpus, vocab_size=1000, seed=seed,
                                      **MODEL_SHAPE)
    return paths

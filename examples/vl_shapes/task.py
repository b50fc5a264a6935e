"""The visual task of the vl_shapes example, drawn locally with PIL: each image holds 1-4 filled shapes of one
colour on a white background; the question asks either how many shapes there are (answer "1".."4") or their colour
(answer "red", "green" or "blue"). Exact answers, no download. Writes train.jsonl / test.jsonl (prompt with one
`<image>` placeholder, `images` column of PNG paths, `label`) and sft.jsonl (the same rows: the SFT warm start's
target is the label).

    python -m examples.vl_shapes.task OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
IMAGE_SIZE = 56  # 2 x 2 merged patches of 28 pixels: 4 image tokens with the tiny processor
QUESTIONS = {"count": "<image>How many shapes?", "colour": "<image>What colour are the shapes?"}


def draw(num_shapes: int, colour: str, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    pen = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(2) for y in range(2)], num_shapes)  # one shape per quadrant
    for x, y in cells:
        left, top = x * 28 + rng.randint(2, 6), y * 28 + rng.randint(2, 6)
        size = rng.randint(14, 20)
        box = (left, top, left + size, top + size)
        kind = rng.choice(("circle", "square", "triangle"))
        if kind == "circle":
            pen.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            pen.rectangle(box, fill=COLOURS[colour])
        else:
            pen.polygon([(left, top + size), (left + size, top + size), (left + size // 2, top)], fill=COLOURS[colour])
    return image


def build_task(out_dir: str | Path, num_train: int = 240, num_test: int = 48, seed: int = 0) -> dict[str, Path]:
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = {}
    for split, count in (("train", num_train), ("test", num_test)):
        rows = []
        for index in range(count):
            num_shapes, colour = rng.randint(1, 4), rng.choice(sorted(COLOURS))
            path = out_dir / "images" / f"{split}_{index}.png"
            draw(num_shapes, colour, rng).save(path)
            question = "count" if index % 2 == 0 else "colour"
            label = str(num_shapes) if question == "count" else colour
            rows.append({"prompt": QUESTIONS[question], "images": [str(path)], "label": label})
        files[split] = out_dir / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


if __name__ == "__main__":
    print(build_task(sys.argv[1] if len(sys.argv) > 1 else "runs/vl_shapes/data"))

"""A local retrieval server for the Search-R1 example: BM25 (the `bm25s` library) over a JSONL corpus, answering
Search-R1's `/retrieve` API over HTTP on loopback.

    python -m examples.search_r1.retrieval_server --corpus corpus.jsonl [--port 0] [--ready-file PATH]

POST /retrieve {"queries": ["capital of Zorvia"], "topk": 2} -> {"result": [[{"contents": ..., "score": ...}]]};
GET /health -> {"status": "ok", "num_documents": N}. A malformed request is a 400 whose JSON "error" says what is
wrong. Corpus rows are {"contents": "..."}. Not a production search service: one process, the whole index in
memory, stdlib http.server (a thread per request, retrieval serialised by a lock).
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import bm25s

LOOPBACK = "127.0.0.1"
MAX_TOPK = 20


class BM25Index:
    """BM25 over a list of documents; `search` returns the top-k (contents, score) pairs, best first."""

    def __init__(self, documents: list[str]):
        if not documents:
            raise ValueError("the corpus is empty: a BM25 index needs at least one document")
        self.documents = list(documents)
        self._retriever = bm25s.BM25()
        self._retriever.index(bm25s.tokenize(self.documents, stopwords="en", show_progress=False),
                              show_progress=False)
        self._lock = threading.Lock()

    def search(self, query: str, topk: int) -> list[tuple[str, float]]:
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # only stopwords or punctuation: nothing to match
            return []
        k = min(topk, len(self.documents))
        with self._lock:
            ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        return [(self.documents[int(i)], float(s)) for i, s in zip(ids[0], scores[0]) if s > 0]


def load_corpus(path: str | Path) -> list[str]:
    documents = []
    for line_number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
            raise ValueError(f"{path}:{line_number}: a corpus row must be {{\"contents\": \"...\"}}, got {line[:80]!r}")
        documents.append(row["contents"])
    return documents


def parse_retrieve_request(body: bytes) -> tuple[list[str], int]:
    """(queries, topk) of a /retrieve body; ValueError naming the bad field."""
    try:
        payload = json.loads(body or b"null")
    except json.JSONDecodeError as error:
        raise ValueError(f"the body is not JSON ({error.msg})") from None
    if not isinstance(payload, dict):
        raise ValueError('the body must be a JSON object {"queries": [...], "topk": k}')
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError('"queries" must be a list of strings')
    topk = payload.get("topk", 3)
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f'"topk" must be an integer from 1 to {MAX_TOPK}, got {topk!r}')
    return queries, topk


def make_handler(index: BM25Index):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._reply(200, {"status": "ok", "num_documents": len(index.documents)})
            else:
                self._reply(404, {"error": f"no route {self.path}; use POST /retrieve or GET /health"})

        def do_POST(self):
            if self.path != "/retrieve":
                self._reply(404, {"error": f"no route {self.path}; use POST /retrieve"})
                return
            try:
                queries, topk = parse_retrieve_request(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except ValueError as error:
                self._reply(400, {"error": str(error)})
                return
            hits = [index.search(query, topk) for query in queries]
            self._reply(200, {"result": [[{"contents": text, "score": score} for text, score in h] for h in hits]})

        def log_message(self, format, *args):  # noqa: A002 - one line per request would flood the run's log
            pass

    return Handler


def make_server(index: BM25Index, port: int = 0) -> ThreadingHTTPServer:
    """A server bound to loopback (port 0: a free one; read it from `server.server_address[1]`)."""
    server = ThreadingHTTPServer((LOOPBACK, port), make_handler(index))
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="JSONL, one {\"contents\": ...} per line")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (written to --ready-file)")
    parser.add_argument("--ready-file", default=None, help="written with {\"url\": ...} once the server answers")
    opts = parser.parse_args()
    index = BM25Index(load_corpus(opts.corpus))
    server = make_server(index, opts.port)
    url = f"http://{LOOPBACK}:{server.server_address[1]}/retrieve"
    if opts.ready_file:
        temporary = Path(opts.ready_file + ".tmp")
        temporary.write_text(json.dumps({"url": url}))
        temporary.replace(opts.ready_file)  # atomic: a reader never sees half a file
    print(f"retrieval server at {url} ({len(index.documents)} documents)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()

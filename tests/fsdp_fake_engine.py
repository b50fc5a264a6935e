"""A stand-in engine for the weight-push tests: implements the three weight endpoints of the SGLang-compatible
API with slime.utils.weight_transport and records what arrived. Run: python fsdp_fake_engine.py PORT OUT_FILE.
GET /received returns the request log; POST /dump writes {name: tensor} of everything received to OUT_FILE."""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from slime.utils import weight_transport

received: dict[str, torch.Tensor] = {}
log: list[dict] = []
groups: dict = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, payload, status=200):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            return self._reply({})
        if self.path == "/received":
            return self._reply(log)
        self._reply({"error": "not found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/update_weights_from_tensor":
            (serialized,) = body["serialized_named_tensors"]
            tensors = weight_transport.deserialize_named_tensors(serialized)
            received.update({name: t.clone() for name, t in tensors})
            log.append({"path": self.path, "names": [n for n, _ in tensors], "flush_cache": body["flush_cache"],
                        "weight_version": body.get("weight_version")})
        elif self.path == "/init_weights_update_group":
            groups[body["group_name"]] = weight_transport.init_custom_process_group(
                body["backend"], f"tcp://{body['master_address']}:{body['master_port']}", body["world_size"],
                body["rank_offset"], body["group_name"])
            log.append({"path": self.path, **body})
        elif self.path == "/update_weights_from_distributed":
            tensors = weight_transport.receive_named_tensors(groups[body["group_name"]], body["names"],
                                                             body["dtypes"], body["shapes"])
            received.update(dict(tensors))
            log.append({"path": self.path, "names": body["names"], "flush_cache": body["flush_cache"],
                        "weight_version": body.get("weight_version")})
        elif self.path == "/dump":
            torch.save(received, sys.argv[2])
        else:
            return self._reply({"error": "not found"}, 404)
        self._reply({"success": True})


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()

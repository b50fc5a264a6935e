"""Which /generate failures are re-sent under --use-fault-tolerance: the router's answers for an engine that did not
answer (verbatim sglang-router 0.3.2 bodies), never a request the engine refused or an error it reported itself."""

import pytest

from slime.rollout.resend import is_engine_failure
from slime.utils.http_utils import EndpointUnreachableError, HTTPRequestError

UPSTREAM = ('{"error":{"type":"Internal Server Error","code":"call_upstream_request_error","message":"error sending '
            'request for url (http://127.0.0.1:11343/generate)"}}')
# an engine of two ranks whose rank 1 was killed: its server exited while answering
BODY_CUT = ('{"error":{"type":"Internal Server Error","code":"read_response_body_failed","message":"Failed to get '
            'response body: error decoding response body"}}')


@pytest.mark.parametrize("error, resent", [
    (HTTPRequestError("router", 500, UPSTREAM), True),
    (HTTPRequestError("router", 500, BODY_CUT), True),
    (EndpointUnreachableError("no router"), True),
    (HTTPRequestError("engine", 500, '{"error": {"message": "CUDA error: an illegal memory access"}}'), False),
    (HTTPRequestError("bad request", 400, '{"error": {"code": "read_response_body_failed"}}'), False),
])
def test_only_an_engine_that_did_not_answer_is_re_sent(error, resent):
    assert is_engine_failure(error) is resent

"""Token-level stop conditions, checked after every sampled token.

Stop *strings* need text and are matched by the detokenizer in the front end,
which then aborts the request in the core.
"""

from __future__ import annotations

from engine.sched.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Marks ``request`` finished if its last token ends it; returns whether it did.

    A structured-output request whose grammar has ended stops first (its stop
    token is the grammar's last). EOS (unless ``ignore_eos``) and
    ``stop_token_ids`` are honoured only once ``min_tokens`` outputs exist; the
    length caps always apply. A stop token wins over a length cap reached by
    the same token (finish_reason "stop").
    """
    params = request.sampling_params
    num_output_tokens = len(request.output_token_ids)
    if request.grammar is not None and request.grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        if request.output_token_ids[-1] in params.stop_token_ids:
            request.stop_reason = request.output_token_ids[-1]
        return True
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if num_output_tokens >= request.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False

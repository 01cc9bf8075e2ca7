"""One request's record: what the client saw of it, as raw clock stamps. Data only: the client
(:mod:`k3pipe.bench.client`) writes it, the summaries, the warm-up analysis and the report read it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["RequestRecord"]


class RequestRecord(BaseModel):
    """What happened to one request, as raw ``time.perf_counter()`` stamps (seconds).

    ``chunk_times`` holds the arrival of every token-bearing chunk; a chunk may carry several tokens
    (speculative decoding, server-side batching of the stream), so token counts come from ``usage``.
    """

    model_config = ConfigDict(extra="forbid")

    index: int = Field(description="Position of the request's prompt in the prompts given.")
    warmup: bool = Field(description="A warm-up request: sent before the measured ones, not measured.")
    prompt_tokens: int = Field(description="Prompt tokens counted client-side (no chat template).")
    max_tokens: int = Field(description="max_tokens sent with the request.")
    usage_prompt_tokens: int | None = Field(
        default=None, description="usage.prompt_tokens of the final chunk (server-side, with template)."
    )
    usage_output_tokens: int | None = Field(
        default=None, description="usage.completion_tokens of the final chunk; None if the server sent none."
    )
    t_scheduled: float = Field(
        description=(
            "perf_counter at which the schedule made the request due: its arrival time under "
            "'constant'/'poisson' load; the moment a slot freed (= t_send) under 'concurrency' and warm-up."
        )
    )
    t_send: float = Field(
        description=(
            "perf_counter right after the request's bytes were written to the socket (after any wait "
            "for a connection and its opening); the call's start if nothing was sent."
        )
    )
    t_first_delta: float | None = Field(
        default=None, description="Arrival of the first chunk carrying content, reasoning or tool calls."
    )
    t_first_content: float | None = Field(
        default=None, description="Arrival of the first chunk with non-empty delta.content (or text)."
    )
    chunk_times: list[float] = Field(
        default_factory=list, description="Arrival of every token-bearing chunk, in order."
    )
    chunk_tokens: list[int] | None = Field(
        default=None,
        description=(
            "Output tokens each token-bearing chunk carried (the rise of the running "
            "usage.completion_tokens since the previous one; the first counts every token up to it); "
            "None unless every token-bearing chunk carried usage (continuous_usage_stats)."
        ),
    )
    output_text: str | None = Field(
        default=None,
        description="Generated text (content, reasoning), kept only when the server sent no usage at all.",
    )
    retokenized_output_tokens: int | None = Field(
        default=None,
        description="Tokens of output_text under the model's tokenizer (the fallback when usage is absent).",
    )
    t_end: float = Field(description="End of the stream ([DONE], close, error or timeout).")
    status_code: int | None = Field(default=None, description="HTTP status; None if no response came.")
    finish_reason: str | None = Field(default=None, description="Last finish_reason the server sent.")
    saw_done: bool = Field(default=False, description="The stream ended with 'data: [DONE]'.")
    error: str | None = Field(default=None, description="Why the request failed; None if it succeeded.")

    @property
    def ok(self) -> bool:
        """The request succeeded."""
        return self.error is None

"""Text <-> token ids for one model: the offline API and the server share it."""

from __future__ import annotations

from mvllm.errors import InvalidRequestError

Prompt = str | list[int]


class Tokenizer:
    """Text <-> ids for one model; a synthetic model has none and accepts only token ids."""

    def __init__(self, hf_tokenizer, model_spec: str):
        self.hf, self.model_spec = hf_tokenizer, model_spec

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.hf is None:
                raise InvalidRequestError(
                    f"model {self.model_spec} has no tokenizer; pass the prompt as a list of token ids", "prompt")
            return self.hf.encode(prompt, add_special_tokens=True)
        if not set(map(type, prompt)) <= {int}:  # ints, not bools (nor int subclasses), in C's loops
            raise InvalidRequestError("a prompt must be a string or a list of integer token ids", "prompt")
        return list(prompt)

    def parse_ids(self, text: str) -> list[int]:
        """Comma-separated token ids, the prompt form for models without a tokenizer."""
        try:
            return [int(t) for t in text.replace(" ", "").split(",") if t]
        except ValueError:
            raise InvalidRequestError(f"model {self.model_spec} has no tokenizer; give the prompt as comma-separated "
                                      "token ids, e.g. 1,2,3", "prompt") from None

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError(f"model {self.model_spec} has no chat template", "messages")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.hf is None else self.hf.decode(ids, skip_special_tokens=True)

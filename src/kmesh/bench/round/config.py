"""`kmesh bench round`'s settings (bench/round/run.py), apart from it: the CLI's parser reads their
defaults without importing torch."""

from dataclasses import dataclass

from kmesh.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RoundBenchConfig:
    siblings: int = 16
    segment_tokens: int = 128  # each sibling's output of the last round
    trunk_tokens: int = 2048
    ask_tokens: int = 32
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.siblings < 2:
            raise InvalidRequestError(f"a round needs at least 2 siblings, got {self.siblings}")
        sizes = (self.segment_tokens, self.trunk_tokens, self.ask_tokens, self.repeats)
        if min(sizes) < 1:
            raise InvalidRequestError(
                "--segment-tokens, --trunk-tokens, --ask-tokens and --repeats must be at least 1"
            )

    @property
    def prompt_tokens(self) -> int:
        return self.trunk_tokens + self.siblings * self.segment_tokens + self.ask_tokens

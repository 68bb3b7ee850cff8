"""What S3 requests cost, at public list prices: for `tiercache bench` and the serve
benchmark's figures of requests per 1k tokens and dollars per million tokens stored.

Prices: Amazon S3 Standard, US East (N. Virginia), from https://aws.amazon.com/s3/pricing/
as listed in November 2026: PUT, COPY, POST, LIST $0.005 per 1,000 requests; GET,
SELECT and all other requests $0.0004 per 1,000. Storage and transfer are left out:
they scale with bytes, which packing does not change."""

from __future__ import annotations

from dataclasses import dataclass

PUT_USD_PER_1000 = 0.005
GET_USD_PER_1000 = 0.0004


@dataclass(frozen=True)
class RequestFigures:
    """S3 requests of one measured workload, per token."""

    puts: float
    gets: float
    tokens_stored: int
    tokens_loaded: int

    @property
    def puts_per_1k_tokens_stored(self) -> float:
        return 1000 * self.puts / self.tokens_stored if self.tokens_stored else 0.0

    @property
    def gets_per_1k_tokens_loaded(self) -> float:
        return 1000 * self.gets / self.tokens_loaded if self.tokens_loaded else 0.0

    @property
    def usd_per_million_tokens_stored(self) -> float:
        """What storing a million tokens costs in PUT requests."""
        return self.puts_per_1k_tokens_stored * 1000 * PUT_USD_PER_1000 / 1000

    @property
    def usd_per_million_tokens_loaded(self) -> float:
        return self.gets_per_1k_tokens_loaded * 1000 * GET_USD_PER_1000 / 1000

    def as_dict(self) -> dict[str, float]:
        return {
            "puts": self.puts,
            "gets": self.gets,
            "tokens_stored": self.tokens_stored,
            "tokens_loaded": self.tokens_loaded,
            "puts_per_1k_tokens_stored": round(self.puts_per_1k_tokens_stored, 4),
            "gets_per_1k_tokens_loaded": round(self.gets_per_1k_tokens_loaded, 4),
            "usd_per_million_tokens_stored": round(self.usd_per_million_tokens_stored, 6),
            "usd_per_million_tokens_loaded": round(self.usd_per_million_tokens_loaded, 6),
        }


def requests_sent(op: str) -> float:
    """tiercache_s3_requests_total{op} in this process so far."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tiercache_s3_requests_total", {"op": op}) or 0.0

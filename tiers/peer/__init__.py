"""The peer tier: blocks read from another live instance's CPU tier over NIXL."""

from tiercache.tiers.peer.tier import PeerRead, PeerTier

__all__ = ["PeerRead", "PeerTier"]

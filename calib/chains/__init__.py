"""Draft chain kinds (docs/chains.md): the registry (:mod:`calib.chains.base`) with the built-in kinds
registered, one file each (:mod:`calib.chains.model`, :mod:`calib.chains.ngram`, :mod:`calib.chains.suffix`)."""

from calib.chains.base import (
    CONTEXT,
    NO_CHAIN,
    Axis,
    ChainKind,
    Offer,
    RoundData,
    chain,
    chain_names,
    chain_of_method,
    chains,
    confidence_chain,
    context_axes,
    context_spec,
    offer_inputs,
    recomputed_chains,
    register_chain,
    resolve_edges,
    split_context,
    unregister_chain,
    verified_chain,
)
from calib.chains.model import MODEL
from calib.chains.ngram import NGRAM
from calib.chains.rounds import round_inputs
from calib.chains.suffix import SUFFIX

register_chain(MODEL)
register_chain(NGRAM)
register_chain(SUFFIX)

__all__ = ["CONTEXT", "NO_CHAIN", "Axis", "ChainKind", "Offer", "RoundData", "chain", "chain_names",
           "chain_of_method", "chains", "confidence_chain", "context_axes", "context_spec", "offer_inputs", "recomputed_chains", "register_chain",
           "resolve_edges", "round_inputs", "split_context", "unregister_chain", "verified_chain"]

"""SYNTHETIC banks for unit tests only: random rounds in the public layout, not engine data."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from calib.bank import schema


def synthetic_tables(n_prompts=4, rounds_per_prompt=5, width=4, seed=0, with_ngram=True,
                     category=("chat", "code_edit"), speculator="synthetic", conf=True, extras=False):
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(n_prompts):
        for r in range(rounds_per_prompt):
            drafted = int(rng.integers(1, width + 1))
            accept = int(rng.integers(0, drafted + 1))
            rows.append((p, r, drafted, accept))
    n = len(rows)
    keys = {
        "model": ["synthetic-model"] * n, "speculator": [speculator] * n,
        "config": [f"{speculator}-k{width}"] * n,
        "category": [category[p % len(category)] for p, *_ in rows],
        "prompt_idx": [p for p, *_ in rows], "turn": [0] * n, "round_idx": [r for _, r, *_ in rows],
    }
    key_schema = [pa.field(k, schema.KEY_TYPES[k]) for k in schema.KEYS]
    acc = {**keys, "accept": [a for *_, a in rows]}
    spec = dict(keys)
    for k in range(width):
        acc[f"acc{k}"] = [(1 if k < a else 0) if k < d else None for _, _, d, a in rows]
        spec[f"conf{k}"] = [float(rng.uniform()) if (conf and k < d) else None for _, _, d, _ in rows]
    acceptance = pa.table(acc, schema=pa.schema(
        key_schema + [pa.field("accept", pa.int64())] + [pa.field(f"acc{k}", pa.int8()) for k in range(width)]))
    fields = key_schema + [pa.field(f"conf{k}", pa.float64()) for k in range(width)]
    if extras:  # drafter entropy and top-1/top-2 margin where a token was drafted
        for name in ("entropy", "margin"):
            for k in range(width):
                spec[f"{name}{k}"] = [float(rng.uniform()) if c is not None else None for c in spec[f"conf{k}"]]
                fields.append(pa.field(f"{name}{k}", pa.float64()))
    speculator_t = pa.table(spec, schema=pa.schema(fields))
    ngram = None
    if with_ngram:
        ng = dict(keys)
        lens = rng.integers(0, width + 1, size=n)
        acc_ng = [int(rng.integers(0, l + 1)) if l else None for l in lens]
        ng["ngram_len"] = lens.tolist()
        for name, typ in schema.NGRAM_FEATURES.items():
            if pa.types.is_boolean(typ):
                vals = [bool(rng.integers(0, 2)) for _ in range(n)]
            elif name == "agreement":
                vals = rng.uniform(size=n).tolist()
            else:
                vals = rng.integers(1, 50, size=n).tolist()
            ng[name] = [v if l else None for v, l in zip(vals, lens)]
        ng["accept"] = acc_ng
        ng["verified"] = [False] * n
        ng["label_source"] = ["counterfactual" if l else "none" for l in lens]
        for j in range(width):
            ng[f"ngram_tok{j}"] = [int(rng.integers(0, 1000)) if j < l else None for l in lens]
            ng[f"depth_agreement{j}"] = [float(rng.uniform(0.05, 1)) if j < l else None for l in lens]
            ng[f"acc{j}"] = [(1 if j < a else 0) if (a is not None and j < l) else None
                             for l, a in zip(lens, acc_ng)]
        fields = key_schema + [pa.field(c, t) for c, t in schema.NGRAM_ROUND.items()]
        fields += [pa.field(f"ngram_tok{j}", pa.int64()) for j in range(width)]
        fields += [pa.field(f"depth_agreement{j}", pa.float64()) for j in range(width)]
        fields += [pa.field(f"acc{j}", pa.int8()) for j in range(width)]
        ngram = pa.table(ng, schema=pa.schema(fields))
    return acceptance, speculator_t, ngram


def two_chain_tables(model_grid, edges, strides, ngram_grid, reuse_last_row: bool = False, features=None):
    """GridTables with the model chain (one interpolated confidence axis over ``model_grid``'s G
    points) and the n-gram chain (binned axes named ``features``, default f0, f1, ..., with inner
    ``edges`` [F, E] (+inf padded) and ``strides``), from tensors or arrays."""
    import math

    import torch

    from calib.chains import Axis
    from calib.tables.layout import ChainTable, GridTables

    model_grid, edges = torch.as_tensor(model_grid, dtype=torch.float32), torch.as_tensor(edges, dtype=torch.float32)
    model = ChainTable.build((Axis("conf", points=model_grid.shape[1]),), model_grid)
    names = list(features) if features is not None else [f"f{i}" for i in range(edges.shape[0])]
    axes = tuple(Axis(n, edges=tuple(float(e) for e in row if math.isfinite(e))) for n, row in zip(names, edges.tolist()))
    ngram = ChainTable.build(axes, ngram_grid, edges, strides)
    return GridTables({"model": model, "ngram": ngram}, reuse_last_row=reuse_last_row)

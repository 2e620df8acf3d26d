"""EAGLE-2 dynamic draft trees over a chain head (mtp / eagle1 / deepseek_mtp / eagle3).

Per depth, the top-k children of the `tree_topk` best nodes (by cumulative draft log-prob) are
added; the head runs on the nodes chosen for expansion, each attending to the cached prefix and its
ancestors (a tree mask over the head's paged cache). The best `tree_tokens` nodes overall form the
tree the target verifies in one pass (engine `_tree_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.inference.proposers import HeadChainProposer
from headstart.inference.scheduler import Sequence


@dataclass
class Tree:
    """A draft tree for one sequence. Node 0 is the root (the pending token t_n); nodes are in
    verification order (by depth). children[i] lists node i's children in the order they are tried."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    children: list[list[int]]

    def ancestors(self, i: int) -> list[int]:
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def mask(self, prefix: int) -> torch.Tensor:
        """(M+1, prefix+M+1) bool: node i sees the prefix, the root, its ancestors and itself."""
        m = len(self.tokens)
        mask = torch.zeros(m, prefix + m, dtype=torch.bool)
        mask[:, : prefix + 1] = True
        for i in range(1, m):
            for a in self.ancestors(i):
                mask[i, prefix + a] = True
        return mask


class TreeProposer(HeadChainProposer):
    """EAGLE-2 dynamic trees over a chain head: expand the top-k children of the best `tree_topk`
    nodes per depth (by cumulative draft log-prob), then keep the best `tree_tokens` nodes overall.
    Head rows for expanded nodes attend to the prefix and their ancestors (tree mask)."""

    method = "tree"

    def propose_trees(self, seqs: list[Sequence]) -> list[Tree]:
        cfg = self.config
        topk, depth_limit = cfg.tree_topk, cfg.k
        n = [s.num_cached for s in seqs]
        # Per sequence: candidate nodes (token, parent, depth, score); node 0 is the root.
        tok = [[s.token_ids[-1]] for s in seqs]
        par = [[-1] for _ in seqs]
        dep = [[0] for _ in seqs]
        score = [[0.0] for _ in seqs]
        head_row: list[dict[int, int]] = [{} for _ in seqs]  # node -> head KV index (expanded nodes)
        frontier = [[(0, s.draft.carry[0][0], s.draft.carry[1][0])] for s in seqs]
        for d in range(1, depth_limit + 1):
            chosen: list[list[int]] = []
            for b in range(len(seqs)):
                new = []
                for node, _, logits in frontier[b]:
                    lp = torch.log_softmax(logits.float(), -1)
                    vals, ids = lp.topk(min(topk, lp.numel()))
                    tids = self.to_target(ids).tolist()
                    for v, t in zip(vals.tolist(), tids):
                        tok[b].append(t)
                        par[b].append(node)
                        dep[b].append(d)
                        score[b].append(score[b][node] + v)
                        new.append(len(tok[b]) - 1)
                new.sort(key=lambda i: -score[b][i])
                chosen.append(new[:topk])
            if d == depth_limit:
                break
            # Run the head on the chosen nodes: row (parent's output, token) at RoPE position n + d - 1.
            items, masks, positions, feats, tokens = [], [], [], [], []
            for b, s in enumerate(seqs):
                base = n[b] + len(head_row[b])
                rows = chosen[b]
                for j, node in enumerate(rows):
                    head_row[b][node] = base + j
                kv_len = base + len(rows)
                mask = torch.zeros(len(rows), kv_len, dtype=torch.bool)
                mask[:, : n[b]] = True
                for j, node in enumerate(rows):
                    a = node
                    while a > 0:
                        mask[j, head_row[b][a]] = True
                        a = par[b][a]
                items.append((s.id, base, kv_len))
                masks.append(mask)
                positions.append([n[b] + d - 1] * len(rows))
                parent_feat = {nd: f for nd, f, _ in frontier[b]}
                feats.extend(parent_feat[par[b][node]] for node in rows)
                tokens.extend(tok[b][node] for node in rows)
            h, _, _ = self.runner.run(tokens, items, features=torch.stack(feats), masks=masks, positions=positions)
            logits = self.runner.logits(h)
            row = 0
            for b in range(len(seqs)):
                frontier[b] = [(node, h[row + j], logits[row + j]) for j, node in enumerate(chosen[b])]
                row += len(chosen[b])
        return [self._rerank(tok[b], par[b], dep[b], score[b]) for b in range(len(seqs))]

    def _rerank(self, tok: list[int], par: list[int], dep: list[int], score: list[float]) -> Tree:
        budget = self.config.tree_tokens
        best = sorted(range(1, len(tok)), key=lambda i: -score[i])[:budget]
        keep = set(best)
        for i in best:  # ancestors score at least as high, but ties could drop one: keep them all
            a = par[i]
            while a > 0:
                keep.add(a)
                a = par[a]
        order = [0] + sorted(keep, key=lambda i: (dep[i], -score[i]))
        new_id = {old: j for j, old in enumerate(order)}
        children: list[list[int]] = [[] for _ in order]
        for old in order[1:]:
            children[new_id[par[old]]].append(new_id[old])
        for c in children:
            c.sort(key=lambda j: -score[order[j]])
        return Tree([tok[i] for i in order], [new_id[par[i]] if i else -1 for i in order], [dep[i] for i in order],
                    children)

"""`kvcluster cluster up|status|down`: registered by entry point, so the core CLI never imports Ray."""

from __future__ import annotations

import argparse
import json

from kvcluster.cli import _human_bytes, _subparser, _table
from kvcluster.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    from kvcluster.cluster_config import load_cluster_config

    cfg = load_cluster_config(args.config)  # a bad file fails here, before Ray starts
    if args.purge and args.action != "down":
        raise ConfigError("--purge goes with down only")
    try:
        from . import cluster  # Ray only for this command
    except ImportError as exc:
        raise ConfigError(f"the cluster command needs Ray and NIXL: pip install 'kvcluster[cluster]' ({exc})") from None

    try:
        cluster.connect(args.address)
    except cluster.ClusterUnreachable:
        if not (args.action == "down" and args.purge):
            raise
        return _purge_only(cfg, args.json)  # nothing running to stop: the files are all that is left
    if args.action == "up":
        result = cluster.up(cfg)
        text = f"started {len(result['tiers'])} tier actors ({', '.join(result['tiers'])}); " \
               f"blocks of {_human_bytes(result['block_bytes'])}; index, predictor and one controller per node " \
               f"({result['policy']}) running"
    elif args.action == "down":
        result = {"killed": cluster.down(cfg)}
        text = f"stopped {len(result['killed'])} actors"
        if args.purge:
            from kvcluster.state_files import purge

            result["purged"] = purge(cfg)
            text += f"; removed {', '.join(result['purged']) or 'nothing (no state files)'}"
        else:
            text += " (files on nvme and pfs are kept; --purge removes them)"
    else:
        result = cluster.status(cfg)
        rows = [[r["node"], r["tier"], r["state"], str(r.get("used_blocks", "-")), str(r.get("capacity_blocks", "-"))]
                for r in result["tiers"]]
        text = _table(rows, ["node", "tier", "state", "blocks", "capacity"])
        for node, control in (result.get("control") or {}).items():
            if not isinstance(control, dict):
                text += f"\ncontroller of {node}: {control or 'absent'}"
                continue
            text += f"\ncontroller of {node}: policy {control['policy']}, {control['stores']} stores placed, " \
                    f"{control['written']} blocks written, {control['refused']} refused, " \
                    f"{control['in_flight']} in flight"
    print(json.dumps(result) if args.json else text)
    return 0


def _purge_only(cfg, as_json: bool) -> int:
    from kvcluster.state_files import purge

    removed = purge(cfg)
    print(json.dumps({"killed": [], "purged": removed}) if as_json else
          f"no Ray cluster running; removed {', '.join(removed) or 'nothing (no state files)'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    cl = _subparser(sub, "cluster", "start, inspect or stop the cache actors on a running Ray cluster",
                    "The cache actors of a cluster YAML on a running Ray cluster (it does not start Ray):\n"
                    "  up      start (or find) the index, predictor, tier actors and node controllers; idempotent\n"
                    "  status  blocks held and capacity per node and tier, and each node controller's totals\n"
                    "  down    stop them (the predictor checkpoints first; nvme and pfs files stay,\n"
                    "          --purge removes them and the predictor checkpoint)",
                    "ray start --head && kvcluster cluster up local\n"
                    "kvcluster cluster up two-workers --address HEAD_IP:6379\n"
                    "kvcluster cluster status two-workers --address HEAD_IP:6379 --json")
    cl.add_argument("action", choices=["up", "status", "down"], help="up, status or down (see above)")
    cl.add_argument("config", help="a cluster YAML (path, or a name under configs/cluster)")
    cl.add_argument("--address", default="auto", help="Ray cluster address, HOST:PORT of the head's GCS "
                                                      "(default auto: the cluster running on this host)")
    cl.add_argument("--purge", action="store_true",
                    help="with down: also remove the state files (nvme slabs, pfs blocks, predictor checkpoint)")
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.set_defaults(func=run)

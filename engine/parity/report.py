"""The parity report as a person reads it (the JSON file holds the same and more)."""

from __future__ import annotations


def _num(value, spec: str = ".8f") -> str:
    return "-" if value is None else format(value, spec)


def _steps(report: dict) -> list[str]:
    lines = ["step | reference loss | mesh loss  | diff    | ref grad norm | mesh grad norm | rel diff",
             "-----|----------------|------------|---------|---------------|----------------|---------"]
    for row in report.get("steps_table", []):
        lines.append(f"{row['step']:>4} | {_num(row.get('reference_loss')):>14} | {_num(row['loss']):>10} | "
                     f"{_num(row.get('loss_diff'), '.1e'):>7} | {_num(row.get('reference_grad_norm'), '.6f'):>13} | "
                     f"{_num(row['grad_norm'], '.6f'):>14} | {_num(row.get('grad_norm_rel_diff'), '.1e'):>7}")
    return lines


def _gradients(report: dict) -> list[str]:
    grads = report.get("gradients")
    if not grads:
        return []
    lines = [f"worst parameters by step-0 gradient difference (limit {grads['limit']:.1e}, "
             f"largest gradient {grads['largest_gradient']:.2e}):"]
    lines += [f"  {diff:.2e}  {name}" for name, diff in grads["worst"]]
    return lines


def _replicated(report: dict) -> list[str]:
    lines = []
    for what, found in report.get("replicated_over_tp", {}).items():
        differing = found["differing"]
        names = ", ".join(list(differing)[:10]) + (", ..." if len(differing) > 10 else "")
        state = "all bit-identical" if not differing else f"{len(differing)} differ: {names}"
        lines.append(f"replicated over tp, {what}: {found['checked']} tensors checked, {state}")
    return lines


def _localizer(found: dict | None) -> list[str]:
    if found is None:
        return []
    first = found["first"]
    header = (f"localizer (step 0 rerun on every rank, torch.compile {found['compile']}; "
              f"{found['values_compared']} values over {found['modules']} modules compared):")
    if first is None:
        if found["compile"] != "off":
            return [header, "  every module agrees without torch.compile: the divergence needs compile, or "
                            "comes from outside step 0's forward and backward (optimizer, clipping, later "
                            "steps). The worst parameters above say where compile changed the gradients."]
        return [header, "  every module's output, input gradient and parameter gradients agree: the "
                        "divergence comes from outside step 0's forward and backward (optimizer, clipping, "
                        "later steps)."]
    lines = [header, f"  first divergence: {first['module']}{_stage(first)} ({first['what']}): max abs diff "
                     f"{first['max_abs_diff']:.2e}, relative {first['relative']:.2e}, tolerance {first['tolerance']:.1e}"]
    lines += [f"  then: {f['module']}{_stage(f)} ({f['what']}) {f['max_abs_diff']:.2e}" for f in found["differing"][1:]]
    return lines


def _pipeline(report: dict) -> list[str]:
    pipeline = report.get("pipeline")
    if not pipeline:
        return []
    stages = " | ".join(",".join(block.rsplit(".", 1)[-1] for block in blocks) or "-"
                        for blocks in pipeline["blocks_per_stage"])
    return [f"pipeline: {pipeline['schedule']}, {len(pipeline['blocks_per_stage'])} stages "
            f"({pipeline['stages_per_rank']} per rank), blocks by stage {stages}, "
            f"{report['micro_batches']} micro-batches"]


def _stage(finding: dict) -> str:
    return f" on pipeline stage {finding['stage']}" if "stage" in finding else ""


def _replica_group(report: dict) -> str:
    group = report.get("replica_group")
    return f"; fault-tolerant replica group {group}" if group else ""


def format_report(report: dict) -> str:
    tol = report["tolerance"]
    grad = f"{tol['grad']:.0e} x largest gradient" if tol["grad_relative"] else f"{tol['grad']:.0e} abs"
    lines = [
        f"parity: mesh {report['mesh']} ({report['world_size']} ranks, {report['device']}"
        f"{_replica_group(report)}) against one "
        f"device ({report['reference']}) | {report['model']} ({report['layers']} blocks), plan {report['plan']} | "
        f"{report['dtype']} | {report['optimizer']} | {report['steps']} steps",
        f"tolerances ({tol['dtype']}, {tol['optimizer']}): step-0 loss {tol['loss']:.0e} abs, gradients {grad}, "
        f"grad norm {tol['norm']:.0e} rel; later steps x{tol['later_factor']:g}; replicated over tp: bitwise",
        *_pipeline(report),
        "",
        *_steps(report),
        "",
        *_gradients(report),
        *_replicated(report),
    ]
    if "weights_max_diff" in report:
        lines.append(f"weights after {report['steps']} steps: max abs diff {report['weights_max_diff']:.2e}")
    if report.get("golden"):
        lines.append(f"checked against the trajectory in {report['golden']}")
    failed = [c for c in report["checks"] if not c["ok"]]
    lines.append("")
    for check in failed:
        detail = f" ({check['detail']})" if check["detail"] else ""
        lines.append(f"FAIL {check['name']}: {check['value']:.3g} > limit {check['limit']:.3g}{detail}")
    lines += _localizer(report.get("localizer"))
    lines.append(f"{report['verdict']}: {len(report['checks']) - len(failed)} of {len(report['checks'])} checks passed")
    return "\n".join(lines)

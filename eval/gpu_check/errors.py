"""One failure as the report records it: what failed, the error in one line, the traceback's tail. Every
measurement of the GPU check runs in its own try/except and hands its failure here, so one failure is
printed and reported and the run goes on."""

import traceback


def error_record(what: str, err: BaseException) -> dict:
    tb = traceback.format_exception(type(err), err, err.__traceback__)
    print(f"[gpu_check] FAILED {what}: {type(err).__name__}: {err}", flush=True)
    return {
        "what": what,
        "error": f"{type(err).__name__}: {str(err)[:500]}",
        "traceback": "".join(tb)[-3000:],
    }

"""``GET /v1/alerts``: the built-in alerts firing now and recently resolved."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from .listing import alert_list
from .service import AlertService

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["alerts"])


@router.get("/alerts", summary="Built-in alerts: firing now and recently resolved")
async def list_alerts(
    request: Request,
    collapse: int | None = Query(None, ge=2, description="alerts of one alert name, run and severity from which "
                                                            "they are one entry (count, ranks) instead of one each"),
    alertname: str | None = Query(None, max_length=200, description="only alerts of this name"),
    run: str | None = Query(None, max_length=1000, description="only alerts of this run"),
) -> dict[str, Any]:
    """Return ``{"firing": [...], "resolved": [...]}``, each alert with name, labels, annotations and times."""
    service: AlertService | None = getattr(request.app.state, "alert_service", None)
    if service is None:
        return {"firing": [], "resolved": []}
    if collapse is None and alertname is None and run is None:
        return service.alerts.to_json()
    return alert_list(service.alerts.firing(), service.alerts.resolved(), collapse_from=collapse,
                      alertname=alertname, run=run)

"""``GET /v1/alerts``: the built-in alerts firing now and recently resolved."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Request

from .service import AlertService

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["alerts"])


@router.get("/alerts", summary="Built-in alerts: firing now and recently resolved")
async def list_alerts(request: Request) -> dict[str, Any]:
    """Return ``{"firing": [...], "resolved": [...]}``, each alert with name, labels, annotations and times."""
    service: Optional[AlertService] = getattr(request.app.state, "alert_service", None)
    if service is None:
        return {"firing": [], "resolved": []}
    return service.alerts.to_json()

"""Counts every HTTP request by endpoint and status (kvcluster_requests)."""

from starlette.middleware.base import BaseHTTPMiddleware

from kvcluster.actors import metrics

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}


class RequestMetrics(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        response = await call_next(request)
        path = request.url.path
        for endpoint in ENDPOINTS:  # mounted under a route prefix: match the tail
            if path.endswith(endpoint):
                path = endpoint
                break
        else:
            path = "other"
        metrics.requests().inc(1, {"endpoint": path, "status": str(response.status_code)})
        return response

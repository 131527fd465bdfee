-- Argo CD health check for omnifleet.dev/OmniPipeline.
-- Install: put this script in argocd-cm under
--   resource.customizations.health.omnifleet.dev_OmniPipeline
-- No Lua standard library is used (Argo CD runs these without it).
hs = {}
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  hs.status = "Progressing"
  hs.message = "Pending deletion"
  return hs
end
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator"
  return hs
end
if obj.metadata ~= nil and obj.status.observedGeneration ~= obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local ready = nil
local stalled = nil
local degraded = nil
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then ready = c end
  if c.type == "Stalled" then stalled = c end
  if c.type == "Degraded" then degraded = c end
end
local function msg(c)
  if c == nil or c.message == nil or c.message == "" then return "" end
  return c.reason .. ": " .. c.message
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or ""
  return hs
end
if (stalled ~= nil and stalled.status == "True") or (degraded ~= nil and degraded.status == "True") then
  hs.status = "Degraded"
  if stalled ~= nil and stalled.status == "True" then hs.message = msg(stalled) else hs.message = msg(degraded) end
  return hs
end
hs.status = "Progressing"
hs.message = msg(ready)
return hs

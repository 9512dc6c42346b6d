#Requires -Version 5.1
#Requires -RunAsAdministrator
<#
.SYNOPSIS
Registers one Windows scheduled task per ortq worker: -WorkersPerAdapter workers on each of
-Adapters, all serving one model, started at boot and restarted when they crash.

.DESCRIPTION
Each task runs ortq-worker-task.ps1 (copied to %ProgramData%\ortq), which sets the worker's
ORTQ_* variables, runs `ortq worker`, appends its output to <LogDir>\<task>.log and restarts it
by its exit status: never after a configuration error (2), at once after a lost device (75),
with a growing delay after a crash. Task Scheduler's own restart setting covers the case where
the task itself cannot start. Tasks live in the Task Scheduler folder \ortq\ and are named
<Name>-a<adapter>-w<worker>; installing a model again first removes its old tasks
(uninstall-ortq-workers.ps1 -Name <Name>).

Not run on Windows by the project (no Windows host): see deploy/README.md for what was checked.

.PARAMETER Model
The .onnx file. The account the tasks run as must be able to read it.

.PARAMETER Name
The model name: the queue is ortq:<Name>, and it prefixes the task names.

.PARAMETER Adapters
Adapter specs as `ortq adapters` and `ortq worker --adapter` take them: "name:Radeon",
"luid:0x000000000001a2b3", "discrete", "0", ... One entry per adapter to serve.

.PARAMETER WorkersPerAdapter
Worker processes per adapter; each holds its own copy of the model in that adapter's memory.

.PARAMETER RedisUrl
redis://[:password@]host:6379/0. Stored in %ProgramData%\ortq\<task>.json, readable only by
SYSTEM, Administrators and the tasks' account; never on a command line.

.PARAMETER OrtqExe
The ortq.exe of the venv that has ortq[worker] installed (e.g. C:\ortq\.venv\Scripts\ortq.exe).

.PARAMETER Provider
dml (DirectML, the default), cuda or cpu.

.PARAMETER User
The account the tasks run as. A service account (NT AUTHORITY\LocalService, the default,
NT AUTHORITY\NetworkService or NT AUTHORITY\SYSTEM) needs no password; any other account needs
-Credential.

.PARAMETER Credential
The password of -User when it is not a service account (Get-Credential).

.PARAMETER LogDir
Where the workers' logs go.

.PARAMETER MetricsPortBase
0: no metrics. Otherwise the tasks' workers serve /metrics, /ready and /live on consecutive
ports from this one, on 127.0.0.1.

.PARAMETER ExtraArguments
More `ortq worker` options for every worker, e.g. @('--max-batch', '16', '--max-wait-ms', '2', '--rows-independent').

.PARAMETER Start
Start the tasks now instead of at the next boot.

.EXAMPLE
.\install-ortq-workers.ps1 -Model C:\models\resnet.onnx -Name resnet -Adapters "name:Radeon","luid:0x000000000001a2b3" -WorkersPerAdapter 2 -RedisUrl redis://redis-host:6379/0 -OrtqExe C:\ortq\.venv\Scripts\ortq.exe -Start
#>
[CmdletBinding()]
param(
    [Parameter(Mandatory = $true)]
    [string] $Model,

    [Parameter(Mandatory = $true)]
    [ValidatePattern('^[A-Za-z0-9_.-]+$')]
    [string] $Name,

    [Parameter(Mandatory = $true)]
    [ValidateNotNullOrEmpty()]
    [string[]] $Adapters,

    [ValidateRange(1, 64)]
    [int] $WorkersPerAdapter = 1,

    [Parameter(Mandatory = $true)]
    [ValidatePattern('^(redis|rediss|unix)://')]
    [string] $RedisUrl,

    [Parameter(Mandatory = $true)]
    [string] $OrtqExe,

    [ValidateSet('dml', 'cuda', 'cpu')]
    [string] $Provider = 'dml',

    [string] $User = 'NT AUTHORITY\LocalService',

    [System.Management.Automation.PSCredential] $Credential,

    [string] $LogDir = (Join-Path $env:ProgramData 'ortq\logs'),

    [ValidateRange(0, 65535)]
    [int] $MetricsPortBase = 0,

    [string[]] $ExtraArguments = @(),

    [switch] $Start
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'

$TaskFolder = '\ortq\'
$StateDir = Join-Path $env:ProgramData 'ortq'
$Supervisor = Join-Path $StateDir 'ortq-worker-task.ps1'
# <Name>-a<adapter>-w<worker>; uninstall-ortq-workers.ps1 matches exactly these names.
$TaskNameFormat = '{0}-a{1}-w{2}'
# Well-known SIDs of LocalSystem, LocalService and NetworkService: accounts without a password.
$ServiceAccountSids = @('S-1-5-18', 'S-1-5-19', 'S-1-5-20')

foreach ($file in @($Model, $OrtqExe)) {
    if (-not (Test-Path -LiteralPath $file -PathType Leaf)) {
        throw "no such file: $file"
    }
}
$modelPath = (Resolve-Path -LiteralPath $Model).Path
$ortqPath = (Resolve-Path -LiteralPath $OrtqExe).Path

try {
    $account = New-Object System.Security.Principal.NTAccount($User)
    $userSid = $account.Translate([System.Security.Principal.SecurityIdentifier]).Value
} catch {
    throw "unknown account ${User}: $_"
}
$isServiceAccount = $ServiceAccountSids -contains $userSid
if (-not $isServiceAccount -and $null -eq $Credential) {
    throw "$User is not a service account: give its password with -Credential (Get-Credential $User)"
}

# A model installed again with fewer adapters or workers must not keep its old tasks.
& (Join-Path $PSScriptRoot 'uninstall-ortq-workers.ps1') -Name $Name -KeepLogs

New-Item -ItemType Directory -Force -Path $StateDir, $LogDir | Out-Null
# The state folder holds the Redis URL and the script the tasks run: only SYSTEM and
# Administrators may change it, and the tasks' account may read it.
& icacls.exe $StateDir /inheritance:r /grant:r '*S-1-5-18:(OI)(CI)F' '*S-1-5-32-544:(OI)(CI)F' "*${userSid}:(OI)(CI)RX" | Out-Null
if ($LASTEXITCODE -ne 0) { throw "icacls failed on $StateDir" }
& icacls.exe $LogDir /grant "*${userSid}:(OI)(CI)M" | Out-Null
if ($LASTEXITCODE -ne 0) { throw "icacls failed on $LogDir" }
Copy-Item -LiteralPath (Join-Path $PSScriptRoot 'ortq-worker-task.ps1') -Destination $Supervisor -Force

# RestartOnFailure covers a task that fails to start; ortq-worker-task.ps1 restarts the worker.
# No time limit, and a laptop on battery keeps its workers.
$settings = New-ScheduledTaskSettingsSet -RestartCount 3 -RestartInterval (New-TimeSpan -Minutes 1) `
    -ExecutionTimeLimit ([TimeSpan]::Zero) -MultipleInstances IgnoreNew -StartWhenAvailable `
    -AllowStartIfOnBatteries -DontStopIfGoingOnBatteries -DontStopOnIdleEnd -Priority 5
$trigger = New-ScheduledTaskTrigger -AtStartup
$powershellExe = Join-Path $env:SystemRoot 'System32\WindowsPowerShell\v1.0\powershell.exe'

$metricsPort = $MetricsPortBase
for ($adapterIndex = 0; $adapterIndex -lt $Adapters.Count; $adapterIndex++) {
    for ($workerIndex = 0; $workerIndex -lt $WorkersPerAdapter; $workerIndex++) {
        $taskName = $TaskNameFormat -f $Name, $adapterIndex, $workerIndex
        $configPath = Join-Path $StateDir "$taskName.json"
        $logPath = Join-Path $LogDir "$taskName.log"
        $workerPort = 0
        if ($MetricsPortBase -gt 0) {
            $workerPort = $metricsPort
            $metricsPort++
        }
        $config = [ordered]@{
            OrtqExe     = $ortqPath
            Arguments   = @('worker') + $ExtraArguments
            LogPath     = $logPath
            Environment = [ordered]@{
                ORTQ_MODEL        = $modelPath
                ORTQ_MODEL_NAME   = $Name
                ORTQ_PROVIDER     = $Provider
                ORTQ_ADAPTER      = $Adapters[$adapterIndex]
                ORTQ_REDIS_URL    = $RedisUrl
                ORTQ_METRICS_PORT = [string] $workerPort
            }
        }
        $config | ConvertTo-Json -Depth 4 | Set-Content -LiteralPath $configPath -Encoding UTF8

        $action = New-ScheduledTaskAction -Execute $powershellExe -WorkingDirectory $StateDir `
            -Argument "-NoProfile -NonInteractive -ExecutionPolicy Bypass -File `"$Supervisor`" -ConfigPath `"$configPath`""
        $description = "ortq worker $workerIndex for model $Name on adapter $($Adapters[$adapterIndex]); log: $logPath"
        if ($isServiceAccount) {
            $principal = New-ScheduledTaskPrincipal -UserId $User -LogonType ServiceAccount -RunLevel Limited
            Register-ScheduledTask -TaskName $taskName -TaskPath $TaskFolder -Action $action -Trigger $trigger `
                -Settings $settings -Principal $principal -Description $description -Force | Out-Null
        } else {
            $password = $Credential.GetNetworkCredential().Password
            Register-ScheduledTask -TaskName $taskName -TaskPath $TaskFolder -Action $action -Trigger $trigger `
                -Settings $settings -User $User -Password $password -RunLevel Limited -Description $description `
                -Force | Out-Null
        }
        if ($Start) {
            Start-ScheduledTask -TaskPath $TaskFolder -TaskName $taskName
        }
        Write-Output "registered $TaskFolder$taskName (adapter $($Adapters[$adapterIndex]), log $logPath)"
    }
}

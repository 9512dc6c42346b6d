#Requires -Version 5.1
#Requires -RunAsAdministrator
<#
.SYNOPSIS
Stops and removes the scheduled tasks install-ortq-workers.ps1 registered: those of one model
(-Name) or all of them (-All), with their configuration files and, unless -KeepLogs, their logs.

.DESCRIPTION
Stopping a task ends its ortq-worker-task.ps1, and with it the worker (a hard kill: the job it
was running is taken back by the model's other workers). Not run on Windows by the project
(no Windows host): see deploy/README.md.

.PARAMETER Name
The model name given to install-ortq-workers.ps1: removes the tasks \ortq\<Name>-*.

.PARAMETER All
Remove every ortq task, and the copy of ortq-worker-task.ps1.

.PARAMETER KeepLogs
Leave the log files.

.PARAMETER LogDir
The -LogDir given to install-ortq-workers.ps1.

.EXAMPLE
.\uninstall-ortq-workers.ps1 -Name resnet
#>
[CmdletBinding(DefaultParameterSetName = 'Model')]
param(
    [Parameter(Mandatory = $true, ParameterSetName = 'Model')]
    [ValidatePattern('^[A-Za-z0-9_.-]+$')]
    [string] $Name,

    [Parameter(Mandatory = $true, ParameterSetName = 'All')]
    [switch] $All,

    [switch] $KeepLogs,

    [string] $LogDir = (Join-Path $env:ProgramData 'ortq\logs')
)

Set-StrictMode -Version Latest
$ErrorActionPreference = 'Stop'

$TaskFolder = '\ortq\'
$StateDir = Join-Path $env:ProgramData 'ortq'
$Supervisor = Join-Path $StateDir 'ortq-worker-task.ps1'
# The names install-ortq-workers.ps1 gives (<Name>-a<adapter>-w<worker>), and no others: a
# prefix match would let -Name resnet remove the tasks of a model called resnet-a1.
$TaskNamePattern = '^{0}-a[0-9]+-w[0-9]+$'

$modelPattern = '.+'
if (-not $All) {
    $modelPattern = [regex]::Escape($Name)
}
$namePattern = $TaskNamePattern -f $modelPattern
# No such folder yet (a first install) is not an error.
$tasks = @(Get-ScheduledTask -TaskPath $TaskFolder -ErrorAction SilentlyContinue | Where-Object { $_.TaskName -match $namePattern })
foreach ($task in $tasks) {
    $taskName = $task.TaskName
    Stop-ScheduledTask -TaskPath $TaskFolder -TaskName $taskName
    Unregister-ScheduledTask -TaskPath $TaskFolder -TaskName $taskName -Confirm:$false
    Remove-Item -LiteralPath (Join-Path $StateDir "$taskName.json") -Force -ErrorAction SilentlyContinue
    if (-not $KeepLogs) {
        Remove-Item -Path (Join-Path $LogDir "$taskName.log*") -Force -ErrorAction SilentlyContinue
    }
    Write-Output "removed $TaskFolder$taskName"
}
if ($All) {
    Remove-Item -LiteralPath $Supervisor -Force -ErrorAction SilentlyContinue
}
